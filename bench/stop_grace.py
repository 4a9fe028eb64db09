"""A stop is committed within the grace, whatever a step costs (issue #53): signal -> committed checkpoint.

    python -m bench.run --only stop_grace     # or: python -m bench.stop_grace [--quick]

Two figures, each on 2 CPU ranks under launch.local, SIGTERM to the launcher's PID (what a kubelet and
`docker stop` do), median of the rounds:

- `stop_grace_long`: steps of ~20 s (40 micro-batches whose forwards each sleep 0.5 s: the test model
  tests/programs/slow_model.py, standing for a slow model or accumulation), the signal right after step 1,
  so mid-step 2. Goal: committed within 5 s, a quarter of the step (the ranks drop the step in flight,
  core/step_drop.py). Before: the step, then the agreement two steps later (~60 s, past any grace).
- `stop_grace_smoke`: the smoke recipe (30 epochs, so that it is never done before the signal lands), the
  signal after step 4: what the change must leave as it was (0.3-0.8 s before it).

The figure is rank 0's own: its `preempted: checkpoint committed ... N s after the signal` line, from the
signal's arrival in the rank to the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, Result, median

COMMAND = "python -m bench.run --only stop_grace"
AFTER = re.compile(r"preempted: checkpoint committed at global step (\d+) in [\d.]+ s, ([\d.]+) s after the signal")
SLOW_FORWARD_S = 0.5
LONG_STEP_MICRO_BATCHES = 40


def argv(run_dir: Path, long_step: bool) -> list[str]:
    slow = ["model.name=tests.programs.slow_model:net", "train.micro_batch_size=2", "train.batch_size=160"]
    return [
        sys.executable, "-m", "torchlaunch.backends.local.launch", "--gpus", "2", "--device", "cpu",
        "--config", "configs/smoke.yaml", f"run_dir={run_dir}", "checkpoint.every_steps=1000",
        *(slow if long_step else ["train.epochs=30"]),  # smoke: never done before the signal lands
    ]  # fmt: skip


def beat_step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "progress" / "rank-0.json").read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def one_stop(run_dir: Path, long_step: bool, at_step: int, timeout_s: float = 600) -> float:
    """Seconds from the signal to the committed checkpoint, as rank 0 measured them."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        TORCHLAUNCH_TEST_FORWARD_S=str(SLOW_FORWARD_S if long_step else 0),
    )
    proc = subprocess.Popen(
        argv(run_dir, long_step), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + timeout_s
        while beat_step(run_dir) < at_step:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the launch ended or stalled before step {at_step}")
            time.sleep(0.05)  # polling another process's heartbeat file: there is no event for a step
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    found = AFTER.search((run_dir / "logs" / "rank-0.log").read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"no committed checkpoint after the signal in {run_dir}")
    return float(found[2])


def run(quick: bool = False, rounds: int = 3) -> list[Result]:
    rounds = 1 if quick else rounds
    work = Path(tempfile.mkdtemp(prefix="bench-stop-grace-"))
    step_s = SLOW_FORWARD_S * LONG_STEP_MICRO_BATCHES
    try:
        long = [one_stop(work / f"long-{i}", True, 1) for i in range(rounds)]
        smoke = [one_stop(work / f"smoke-{i}", False, 4) for i in range(rounds)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [
        Result(
            key="stop_grace_long",
            title="Signal -> committed checkpoint, SIGTERM mid-step, ~20 s steps, 2 CPU ranks (s ÷ the step)",
            project=median(long),
            baseline=step_s,
            unit="s",
            ratio=median(long) / step_s,
            goal=0.25,
            higher_is_better=False,
            command=COMMAND,
            project_label="the step in flight dropped (core/step_drop.py)",
            baseline_label="one step (the least a stop that waits for the step costs)",
            rounds=long,
            notes=f"{LONG_STEP_MICRO_BATCHES} micro-batches of 2 samples per rank, each forward sleeping "
            f"{SLOW_FORWARD_S} s (tests/programs/slow_model.py); SIGTERM to the launcher once rank 0's heartbeat "
            f"says step 1; rank 0's own figure; {rounds} rounds",
        ),
        Result(
            key="stop_grace_smoke",
            title="Signal -> committed checkpoint, the smoke recipe, 2 CPU ranks (s ÷ 1 s)",
            project=median(smoke),
            baseline=1.0,
            unit="s",
            ratio=median(smoke),
            goal=1.0,
            higher_is_better=False,
            command=COMMAND,
            project_label="configs/smoke.yaml",
            baseline_label="1 s (0.3-0.8 s before issue #53)",
            rounds=smoke,
            notes=f"SIGTERM to the launcher once rank 0's heartbeat says step 4; rank 0's own figure; {rounds} rounds",
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of each")
    args = parser.parse_args()
    for r in run(quick=args.quick):
        print(f"{r.key}: {r.project:.2f} s (rounds {', '.join(f'{v:.2f}' for v in r.rounds)}); {r.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
