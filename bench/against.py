"""The CIFAR-10 benches of this tree ÷ those of commit REV, in the same run: a restructuring (issue 27's
split of the data module) must not change the CIFAR recipes' loop or data path.

    python -m bench.run --only loop --data-against REV    # records loop_against and datapath_against
    python -m bench.against REV [--rounds N]              # prints the figures as JSON

REV's files are exported (`git archive`) to a temporary folder; each round runs `bench.loop` and `bench.datapath`
once from each tree, in fresh processes (`python -c` with the tree as the working directory, so that
tree's torchlaunch and bench are imported), alternating which tree goes first. Each tree keeps its own
work folder (its decode cache: the format may differ between commits). The figure per bench is the
median over rounds of this tree's project-side rate ÷ REV's; each side's own ratio (project ÷ its
baseline in the same process) is kept beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO, Result, median, median_ratio

CHILD = """
import json, sys
from pathlib import Path
from bench.common import set_threads
set_threads(1)
name, work, quick = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "quick"
if name == "loop":
    from bench import loop
    r = loop.run(quick=quick)
else:
    from bench import datapath
    r = datapath.run(quick=quick, work=work)
print("RESULT " + json.dumps(None if r is None else r.to_dict()), flush=True)
"""
NAMES = ("loop", "datapath")
TITLES = {
    "loop": "Loop overhead bench (Trainer.train_step + TrainLoader steps/s)",
    "datapath": "Data path bench (TrainLoader images/s, CIFAR-10 in memory)",
}


def child(name: str, tree: Path, work: Path, quick: bool = False) -> dict | None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tree)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, name, str(work), "quick" if quick else "full"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"bench against: {name} in {tree} failed: {done.stderr[-800:]}")
    return json.loads(line[len("RESULT ") :])


def export_tree(rev: str, tree: Path) -> None:
    """REV's files in `tree` by `git archive` (read-only for the repository: no worktree is registered)."""
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, capture_output=True)


def run(rev: str, rounds: int = 2, work: Path | None = None, quick: bool = False) -> list[Result]:
    work = Path(work or tempfile.mkdtemp(prefix="bench-against-"))
    tree = work / f"tree-{rev}"
    export_tree(rev, tree)
    trees = {"this": REPO, rev: tree}
    runs: dict[str, dict[str, list[dict]]] = {side: {n: [] for n in NAMES} for side in trees}
    try:
        for r in range(rounds):
            for side in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                for name in NAMES:
                    out = child(name, trees[side], work / f"work-{side}", quick)
                    if out is not None:
                        runs[side][name].append(out)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    results = []
    for name in NAMES:
        this, then = runs["this"][name], runs[rev][name]
        if not this or not then:
            continue  # datapath without the shared CIFAR-10 tarball: nothing to compare
        ratio, per_round = median_ratio([r["project"] for r in this], [r["project"] for r in then])
        unit = this[0]["unit"]
        results.append(
            Result(
                key=f"{name}_against",
                title=f"{TITLES[name]}: this tree ÷ commit {rev}",
                project=median([r["project"] for r in this]),
                baseline=median([r["project"] for r in then]),
                unit=unit,
                ratio=ratio,
                goal=0.97,
                higher_is_better=True,
                command=f"python -m bench.run --only loop --data-against {rev}",
                project_label=f"bench.{name} from this tree (project side)",
                baseline_label=f"bench.{name} from an export of {rev} (project side)",
                rounds=per_round,
                notes=f"{rounds} alternating rounds, fresh processes, separate work folders; each side's own ratio "
                f"(project ÷ its baseline, same process): this {median([r['ratio'] for r in this]):.3g}, {rev} "
                f"{median([r['ratio'] for r in then]):.3g}; goal: no worse than {rev} beyond the box's noise (3%)",
                extra={"this": [r["project"] for r in this], rev: [r["project"] for r in then], "rev": rev},
            )
        )
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.against", description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the machinery, figures meaningless")
    cli = parser.parse_args()
    print(json.dumps([r.to_dict() for r in run(cli.rev, rounds=cli.rounds, quick=cli.quick)], indent=1))
