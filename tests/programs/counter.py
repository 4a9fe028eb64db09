"""`counter.py STATE_DIR STEPS`: a resumable job without torch. Each rank counts to STEPS, one step
per 0.1 s, keeping its count in STATE_DIR; SIGTERM, SIGUSR1 or SIGUSR2 (what Slurm and Kubernetes
send) make it save the count and exit 75, and the next run continues from it, ten times faster: only
the first run has to be still counting when the stop comes."""

import json
import os
import signal
import sys
import time

from report import importable  # tests/programs/report.py, beside this script

stop = {"signal": 0}


def on_signal(signum: int, frame: object) -> None:
    stop["signal"] = signum


def save(path: str, value: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(value))
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, on_signal)
    state_dir, steps = sys.argv[1], int(sys.argv[2])
    os.makedirs(state_dir, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    path = os.path.join(state_dir, f"count-rank{rank}")
    count = int(open(path).read()) if os.path.exists(path) else 0
    with open(os.path.join(state_dir, f"starts-rank{rank}"), "a") as starts:
        starts.write(f"{count} of {os.environ.get('WORLD_SIZE')} cwd {os.getcwd()}\n")
    with open(os.path.join(state_dir, f"importable-rank{rank}.json"), "w") as seen:
        seen.write(json.dumps(importable()))
    step_s = 0.1 if count == 0 else 0.01
    while count < steps:
        if stop["signal"]:
            print(f"rank {rank}: signal {stop['signal']} at {count}: saved, exit 75", flush=True)
            sys.exit(75)
        time.sleep(step_s)  # one step of work
        count += 1
        save(path, count)
    print(f"rank {rank}: finished {count} steps", flush=True)
