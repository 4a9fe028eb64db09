"""`python -m bench.teardown_smoke [N]`: N 2-rank smoke runs of the built-in worker under launch.local,
counting the teardown aborts ("terminate called without an active exception") and non-zero exits.

Run once by hand (not in CI: each run is a full launch); the figure goes to the report, with the
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


def one(run_dir: Path) -> tuple[int, bool]:
    argv = [sys.executable, "-m", "launch.local", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*argv, f"run_dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, ABORT in done.stdout + done.stderr


def main(argv: list[str]) -> int:
    runs = int(argv[0]) if argv else 50
    aborts = failures = 0
    with tempfile.TemporaryDirectory(prefix="teardown-smoke-") as tmp:
        for i in range(runs):
            code, aborted = one(Path(tmp, f"run{i}"))
            aborts += aborted
            failures += code != 0
            print(f"run {i + 1}/{runs}: exit {code}{' ABORT' if aborted else ''}", flush=True)
    print(f"{runs} runs: {aborts} teardown abort(s), {failures} non-zero exit(s)")
    return 1 if aborts or failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
