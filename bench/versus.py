"""This tree against another commit: start-up and training loop of the same command, interleaved.

    python -m bench.versus --rev 0cbbab9            # 8 rounds, each tree once per round, order alternating
    python -m bench.versus --way-out --rounds 3     # this tree: its default road (live) ÷ recovery.live=false

Why: a refactor (issue 56: the node agent, the config split, the trainer split, the checkpoint seam) must
not cost the user time, and "before" is another tree, not a flag. Both trees run the same command with
the same interpreter and packages (the other tree checked out with `git worktree add --detach`, imported
through PYTHONPATH): `python -m launch.local --gpus 2 --device cpu --config configs/smoke.yaml` on its
synthetic data, 3 epochs (48 steps of 128 images), checkpoints every 8 steps. From each run's
metrics.jsonl: start-up (the worker's `startup_s`: process start to first step done, every import
included) and the loop (median images/s of its logged windows); the launcher's wall time beside them.
Each figure is the median of the per-round ratios this tree / the other, so a change in host load hits
both sides of a round alike. `--way-out` compares the same way the two roads of this tree (issue #54:
live by default must not cost a one-node run its speed): the command as is, and with recovery.live=false.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, load_average

COMMAND = "python -m bench.versus --rev REV"
ARGS = ("--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml", "train.epochs=3")


def checkout(rev: str, where: Path) -> Path:
    """A detached worktree of `rev` (the C extension of the JPEG decoder is not needed: synthetic data)."""
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), rev], check=True, capture_output=True
    )
    return where


def one_run(tree: Path, work: Path, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """The command on `tree` (with `extra` overrides); its start-up, loop images/s and wall time."""
    run_dir = work / "run"
    argv = [sys.executable, "-m", "launch.local", *ARGS, *extra, f"run_dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: exit {done.returncode}: {done.stderr[-1500:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    startup = next(r["startup_s"] for r in lines if "startup_s" in r)
    rates = [r["images_per_s"] for r in lines if "images_per_s" in r]
    events = "".join(p.read_text() for p in (run_dir / "live").glob("events-rank*.jsonl"))
    regroups = events.count('"regrouped"')  # a live run that lost a rank (none is killed here) is not steady
    return {"startup_s": startup, "images_per_s": statistics.median(rates), "wall_s": wall, "regroups": regroups}


RATIOS = ("startup_s", "images_per_s", "wall_s")
"""The figures compared as ratios (a run's regroups are reported beside them)."""
Side = tuple[Path, tuple[str, ...]]
"""A tree and the overrides its runs add."""


def interleaved(sides: dict[str, Side], rounds: int, tmp: str) -> list[dict[str, float]]:
    """`rounds` rounds, each side once per round, the order alternating; each round's ratios first ÷ second."""
    names = list(sides)
    per_round: list[dict[str, float]] = []
    for k in range(rounds):
        got: dict[str, dict[str, float]] = {}
        for name in names if k % 2 == 0 else names[::-1]:
            with tempfile.TemporaryDirectory(dir=tmp) as work:
                got[name] = one_run(sides[name][0], Path(work), sides[name][1])
        ratios = {key: got[names[0]][key] / got[names[1]][key] for key in RATIOS}
        for name in names:
            ratios |= {f"{name}_{key}": got[name][key] for key in ("images_per_s", "regroups")}
        per_round.append(ratios)
        print(f"round {k}: " + ", ".join(f"{key} {v:.3f}" for key, v in ratios.items()), file=sys.stderr)
    return per_round


def summary(what: dict, per_round: list[dict[str, float]], load_before: str) -> dict:
    """The medians of the per-round ratios, the rounds, and the host's load around them."""
    medians = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    return {
        **what,
        "rounds": len(per_round),
        "command": " ".join(["python -m launch.local", *ARGS]),
        "median_ratio_first_over_second": medians,
        "per_round": per_round,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


def compare(rev: str, rounds: int) -> dict:
    """This tree ÷ the other, interleaved: per-round ratios and medians."""
    with tempfile.TemporaryDirectory(prefix="bench-versus-") as tmp:
        other = checkout(rev, Path(tmp) / "other")
        try:
            load_before = load_average()
            per_round = interleaved({"this": (REPO, ()), "other": (other, ())}, rounds, tmp)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], capture_output=True)
    return summary({"rev": rev, "sides": "this tree ÷ rev"}, per_round, load_before)


def way_out(rounds: int) -> dict:
    """This tree's default road (live on two ranks) ÷ its way out (recovery.live=false), interleaved."""
    with tempfile.TemporaryDirectory(prefix="bench-versus-") as tmp:
        load_before = load_average()
        sides = {"live": (REPO, ()), "restart": (REPO, ("recovery.live=false",))}
        per_round = interleaved(sides, rounds, tmp)
    return summary({"sides": "default (live) ÷ recovery.live=false"}, per_round, load_before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.versus", description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="the commit to compare against (e.g. 0cbbab9)")
    parser.add_argument("--way-out", action="store_true", help="this tree's default road ÷ recovery.live=false")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each tree once per round (default 8)")
    args = parser.parse_args(argv)
    if (args.rev is None) == (not args.way_out):
        parser.error("give --rev REV or --way-out")
    print(json.dumps(way_out(args.rounds) if args.way_out else compare(args.rev, args.rounds), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
