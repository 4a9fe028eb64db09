"""A rank slowed from outside to half speed: how much of the slowdown the grid's balance removes, how
soon it finds the slow rank, and that the model's bits do not change (issue #55 item 5).

    python -m bench.straggler                 # 2 rounds of the three runs below
    python -m bench.run --only straggler      # the same, recorded in docs/BENCHMARKS.md

Three runs of the same recipe on `launch.local --gpus 2 --device cpu` (train.exact, 24 micro-batches
per step), rotated every round so all see the same load: healthy (no slowing), slowed with
train.balance=false, slowed with the default (balance on). "Slowed": rank 1's process held by
SIGSTOP/SIGCONT turns to SHARE of the CPU (bench/slow_node.py, 50 ms turns, delivered from this
process), from its start to its end.

The figure: the part of the slowdown the slow rank caused beyond its own share that the balance
removes, (T_off - T_on) / (T_off - T_share), with T the median steady step time and T_share = T_healthy
x W / (W - 1 + SHARE): the pace of a job whose slow rank costs only the compute it lost. Beside it, the
same against the healthy pace, (T_off - T_on) / (T_off - T_healthy), which on W ranks cannot exceed
(T_off - T_share) / (T_off - T_healthy) (2/3 at W = 2): the rest is the slow rank's own lost compute.
On this 2-core box a figure above 1 is possible: a rank stopped half the time frees a core for the
other processes, the other rank's among them, which the capacity model above does not count.
The steps from the slowing to the first move, and the three runs' model SHA-256s, are recorded with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, Result
from bench.live import rank_pids
from bench.slow_node import SlowNode

COMMAND = "python -m bench.run --only straggler"
SHARE = 0.5
WORLD = 2
GRID = 24
"""Micro-batches per step, of BATCH / GRID = 8 samples: fine enough that a half-speed rank's share (a
third of the step's micro-batches) is whole; at 16 (11/5 against the ideal 10.67/5.33) the counts alone
leave ~3% of the step, ~6% of the slowdown, in place."""
BATCH = 192
STEPS = 48
LOG_EVERY = 4
SKIP_WINDOWS = 2
"""Windows of LOG_EVERY steps left out of the steady pace: start-up, and the balance's first look."""
DEADLINE_S = 600.0
BALANCED = re.compile(r"balance: micro-batches per rank (\S+) from global step (\d+)")


def overrides(run_dir: Path, balance: bool, width: int, steps: int) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"data.synthetic_train_size={steps * BATCH}",
        "data.synthetic_val_size=64",
        f"train.batch_size={BATCH}",
        "train.epochs=1",
        "train.exact=true",
        f"train.grid_micro_batches={GRID}",
        f"train.balance={str(balance).lower()}",
        f"train.log_every_steps={LOG_EVERY}",
        f"model.width={width}",
        "train.precision=fp32",
        "train.channels_last=false",
        "checkpoint.every_steps=0",
    ]


def ranks_numbered(pids: list[int], rank: int) -> list[int]:
    """The rank processes among `pids` whose environment says RANK=`rank`."""
    out = []
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            out.append(pid)
    return out


def one_run(run_dir: Path, slowed: bool, balance: bool, width: int, steps: int) -> dict:
    """One run; its median steady step time, its balance lines and its model's SHA-256."""
    argv = [
        sys.executable,
        "-m",
        "launch.local",
        "--gpus",
        str(WORLD),
        "--device",
        "cpu",
        "--config",
        str(REPO / "configs" / "smoke.yaml"),
        *overrides(run_dir, balance, width, steps),
    ]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids: list[int] = []
        if slowed:  # rank 1 from its start (the agent's child running the worker)
            deadline = time.monotonic() + 120
            while len(pids) < WORLD and proc.poll() is None and time.monotonic() < deadline:
                pids = rank_pids(proc.pid)
                time.sleep(0.05)
            slow = ranks_numbered(pids, 1)
            with SlowNode(lambda: slow, SHARE, until=lambda: proc.poll() is not None):
                out, _ = proc.communicate(timeout=DEADLINE_S)
        else:
            out, _ = proc.communicate(timeout=DEADLINE_S)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"run exited {proc.returncode}: {out[-1500:]}")
    seconds = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "images_per_s" in record:
            seconds.append(BATCH / record["images_per_s"])
    moves = [(m.group(1), int(m.group(2))) for m in BALANCED.finditer(out)]
    return {
        "step_s": statistics.median(seconds[SKIP_WINDOWS:]),
        "moves": moves,
        "sha": hashlib.sha256((run_dir / "model.pt").read_bytes()).hexdigest(),
    }


SIDES = {"healthy": (False, False), "off": (True, False), "on": (True, True)}


def results(quick: bool = False, rounds: int = 2, width: int = 64) -> list[Result]:
    steps = STEPS
    if quick:
        rounds, width, steps = 1, 8, 16
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    shas: dict[str, set[str]] = {name: set() for name in SIDES}
    found: list[int] = []
    kept: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as tmp:
        for r in range(rounds):
            order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
            for name in order:
                slowed, balance = SIDES[name]
                run = one_run(Path(tmp) / f"{name}-{r}", slowed, balance, width, steps)
                times[name].append(run["step_s"])
                shas[name].add(run["sha"])
                if name == "on" and run["moves"]:
                    found.append(run["moves"][0][1] - 1)  # steps trained before the first move
                    kept.append(run["moves"][-1][0])
    healthy, off, on = (statistics.median(times[n]) for n in SIDES)
    speed = min(1.0, healthy / off)  # the slowed job's speed, recorded beside the nominal SHARE
    share_pace = healthy * WORLD / (WORLD - 1 + SHARE)
    removed = (off - on) / (off - share_pace) if off > share_pace else 0.0
    versus_healthy = (off - on) / (off - healthy) if off > healthy else 0.0
    equal = len(set().union(*shas.values())) == 1
    return [
        Result(
            key="straggler",
            title=f"A rank at {SHARE:.0%} speed: the slowdown beyond its share that the balance removes (2 CPU ranks)",
            project=on,
            baseline=off,
            unit="s/step",
            ratio=removed,
            goal=0.9,
            higher_is_better=True,
            command=COMMAND,
            project_label=f"train.balance (default): micro-batches moved off the slow rank (last counts {', '.join(kept)})",
            baseline_label="train.balance=false: the even split",
            rounds=[
                round((o - n) / (o - h * WORLD / (WORLD - 1 + SHARE)), 3)
                for h, o, n in zip(times["healthy"], times["off"], times["on"], strict=True)
            ],
            notes=(
                f"rank 1 held to {SHARE:.0%} of the CPU by SIGSTOP/SIGCONT turns of 50 ms from outside; simple_cnn "
                f"width {width}, global batch {BATCH} in {GRID} micro-batches, {steps} steps, median step time after "
                f"{SKIP_WINDOWS} windows of {LOG_EVERY}; healthy {healthy:.3f} s (÷ slowed, balance off: {speed:.2f}), "
                f"its share's pace {share_pace:.3f} s, "
                f"slowed {off:.3f} s (balance off), {on:.3f} s (on); removed against the healthy pace "
                f"{versus_healthy:.2f} (at most {(off - share_pace) / (off - healthy) if off > healthy else 0:.2f} "
                f"on {WORLD} ranks); found after {found} step(s); model SHA-256 of all {3 * rounds} runs "
                f"{'equal' if equal else 'NOT equal'} ({sorted(set().union(*shas.values()))[0][:16]}); {rounds} rounds"
            ),
            extra={
                "healthy_s": healthy,
                "share_pace_s": share_pace,
                "healthy_over_off": speed,
                "removed_vs_healthy": versus_healthy,
                "found_after_steps": found,
                "bits_equal": equal,
            },
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in results(quick=args.quick, rounds=args.rounds, width=args.width):
        print(json.dumps(r.to_dict(), indent=1))


if __name__ == "__main__":
    main()
