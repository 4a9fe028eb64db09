"""`python -m bench.teardown_smoke [N] [--example]`: N 2-rank runs, counting the teardown aborts
("terminate called without an active exception") and non-zero exits.

Default: the built-in worker's smoke recipe under launch.local. `--example`: examples/custom_loop.py
(a user's loop on torchlaunch.api, DDP, a synchronous checkpoint at the end) under plain torchrun,
8 epochs: its ranks leave through the interpreter's own finalisation, where gloo's worker threads
could abort a rank after a clean finish (torchlaunch/core/dist.py `closing_barrier`).

Run by hand (not in CI: each run is a full launch); the figure goes to the report, with the
command. A fresh run dir each time, so every run trains from the start and leaves through teardown.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABORT = "terminate called without an active exception"


def argv_for(run_dir: Path, example: bool) -> list[str]:
    if example:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        return [*torchrun, "examples/custom_loop.py", "--run-dir", str(run_dir), "--epochs", "8"]
    launch = [sys.executable, "-m", "launch.local", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml"]
    return [*launch, f"run_dir={run_dir}"]


def one(run_dir: Path, example: bool) -> tuple[int, bool]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv_for(run_dir, example), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, ABORT in done.stdout + done.stderr


def main(argv: list[str]) -> int:
    example = "--example" in argv
    numbers = [a for a in argv if a != "--example"]
    runs = int(numbers[0]) if numbers else 50
    aborts = failures = 0
    with tempfile.TemporaryDirectory(prefix="teardown-smoke-") as tmp:
        for i in range(runs):
            code, aborted = one(Path(tmp, f"run{i}"), example)
            aborts += aborted
            failures += code != 0
            print(f"run {i + 1}/{runs}: exit {code}{' ABORT' if aborted else ''}", flush=True)
    print(f"{runs} runs: {aborts} teardown abort(s), {failures} non-zero exit(s)")
    return 1 if aborts or failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
