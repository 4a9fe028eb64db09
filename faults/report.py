"""The reliability table: measured outcomes of every fault, as Markdown for docs/RELIABILITY.md.

    python -m faults.report --from runs/faults                       # render what tests/engines/faults saved
    python -m faults.report --from runs/faults --write docs/RELIABILITY.md
    python -m faults.report --run --workdir /tmp/faults              # run the scenarios here (root)

The tests (tests/engines/faults/test_faults.py) save one JSON per scenario when FAULTS_RESULTS_DIR is set,
so `make faults` asserts and measures in a single pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ORDER = [
    "reference",
    "preempt",
    "kill-worker",
    "kill-node",
    "link-down-short",
    "link-down-long",
    "link-cut",
    "crash-mid-checkpoint",
]
TESTS = {  # pytest -k expression of the test that measures each row
    "reference": "preemption",  # the reference run is a fixture of every test in test_faults.py
    "preempt": "preemption",
    "kill-worker": "killed_worker",
    "kill-node": "killed_node",
    "link-down-short": "short_link_outage",
    "link-down-long": "longer_than_the_process_group_timeout",
    "link-cut": "link_cut_for_good",
    "crash-mid-checkpoint": "crash_mid_checkpoint",
}
START, END = "<!-- faults:table:start -->", "<!-- faults:table:end -->"


def _seconds(value: object) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "—"


def _codes(codes: object) -> str:
    return "/".join(str(c) for c in codes) if isinstance(codes, list) else "—"


def outcome_cell(r: dict) -> str:
    first = f"exit {_codes(r['first_codes'])}"
    if r.get("rerun_codes") is not None:
        return f"{first}; rerun exit {_codes(r['rerun_codes'])}"
    return first + (" (group restarted in place)" if r.get("resumed_from") is not None else "")


def render(results: dict[str, dict], seed: str) -> str:
    rows = [
        "| fault | exit codes (node0/node1) | model equal to uninterrupted | attempt ended after"
        " | training past the fault point after | resumed from | steps lost | reproduce |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ORDER:
        r = results.get(name)
        if r is None:
            continue
        equal = {True: "yes", False: "**no**", None: "—"}[r.get("model_equal")]
        resumed = "—" if r.get("resumed_from") is None else f"step {r['resumed_from']}"
        reproduce = f"`FAULTS_SEED={r.get('seed', seed)} .venv/bin/python -m pytest tests/engines/faults/test_faults.py -k {TESTS[name]}`"
        lost = "—" if name == "reference" else str(r["steps_lost"])
        rows.append(
            f"| {r['fault']} | {outcome_cell(r)} | {equal} | {_seconds(r.get('failure_s'))} |"
            f" {_seconds(r.get('recover_s'))} | {resumed} | {lost} | {reproduce} |"
        )
    notes = [
        f"- **{results[n]['fault']}**: {'; '.join(results[n]['notes'])}"
        for n in ORDER
        if results.get(n, {}).get("notes")
    ]
    return "\n".join(rows) + ("\n\nNotes from the run:\n\n" + "\n".join(notes) if notes else "") + "\n"


def load(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def run_all(workdir: Path, seed: str) -> dict[str, dict]:
    """Run the reference and every scenario in one cluster (the same code the tests run)."""
    from faults import scenarios
    from faults.netns import Cluster

    results: dict[str, dict] = {}
    with Cluster() as cluster:
        ref = scenarios.reference(cluster, workdir)
        ref.model_equal = True
        results["reference"] = ref.to_json()
        for name, scenario in scenarios.ALL.items():
            outcome = scenario(cluster, workdir, scenarios.rng_for(name, seed))
            if outcome.model_path and ref.model_path:
                outcome.model_equal = scenarios.models_differ(outcome.model_path, ref.model_path) is None
            results[name] = outcome.to_json()
            print(f"{name}: {outcome_cell(results[name])}, steps lost {outcome.steps_lost}", file=sys.stderr)
    return results


def write_into(doc: Path, table: str) -> None:
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"report error: {doc} lacks the {START} ... {END} markers (add them where the table goes)")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{table}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults.report", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from", dest="folder", type=Path, help="folder of JSON outcomes saved by tests/engines/faults"
    )
    source.add_argument("--run", action="store_true", help="run every scenario now (needs root and ip netns)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/faults-report"), help="run dirs for --run")
    parser.add_argument("--write", type=Path, help="replace the table between the markers in this Markdown file")
    args = parser.parse_args(argv)
    seed = os.environ.get("FAULTS_SEED", "1234")
    if args.run:
        args.workdir.mkdir(parents=True, exist_ok=True)
        results = run_all(args.workdir.resolve(), seed)
    else:
        if not args.folder.is_dir():
            print(f"report error: {args.folder} does not exist (run `make faults` first)", file=sys.stderr)
            return 2
        results = load(args.folder)
        if not results:
            print(f"report error: no outcomes in {args.folder} (set FAULTS_RESULTS_DIR for the tests)", file=sys.stderr)
            return 2
    table = render(results, seed)
    if args.write:
        write_into(args.write, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
