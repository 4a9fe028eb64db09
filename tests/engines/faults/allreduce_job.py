"""A tiny 2-node torchrun job that proves the harness before (and apart from) the real trainer.

Each step all-reduces a tensor over gloo; rank 0 logs a metrics line per step and, every
`--ckpt-every` steps, writes checkpoints/step-N/state.pt in fsynced chunks followed by
COMMITTED.json, the same shape as the real checkpoints. SIGTERM sets a flag; the ranks agree at the
next step and exit 75. A restart resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

PREEMPTED = 75
CHUNK = b"\0" * (256 * 1024)


def newest_committed(root: Path) -> int:
    steps = [int(p.name[5:]) for p in root.glob("step-*") if (p / "COMMITTED.json").is_file()]
    return max(steps, default=0)


def write_checkpoint(root: Path, step: int, total: float, chunks: int) -> None:
    target = root / f"step-{step:09d}"
    target.mkdir(parents=True, exist_ok=True)
    with open(target / "state.pt", "wb") as f:
        for _ in range(chunks):
            f.write(CHUNK)
            f.flush()
            os.fsync(f.fileno())
    (target / "COMMITTED.json").write_text(json.dumps({"step": step, "total": total}))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--ckpt-chunks", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=30)
    args = parser.parse_args()

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    run_dir = Path(args.run_dir)
    root = run_dir / "checkpoints"
    start = newest_committed(root)
    total = 0.0
    if start:
        total = json.loads((root / f"step-{start:09d}" / "COMMITTED.json").read_text())["total"]
    for step in range(start + 1, args.steps + 1):
        value = torch.tensor([float(step), float(stop["flag"])])
        dist.all_reduce(value)
        total += value[0].item()
        time.sleep(args.step_s)  # stands in for the compute of a training step
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "epoch": 0, "loss": total, "lr": 0.0}) + "\n")
            if step % args.ckpt_every == 0 or value[1].item() > 0:
                write_checkpoint(root, step, total, args.ckpt_chunks)
        if value[1].item() > 0:
            dist.barrier()
            print(f"rank {rank}: preempted at step {step}", flush=True)
            return PREEMPTED
    if rank == 0:
        (run_dir / "result.json").write_text(json.dumps({"total": total, "steps": args.steps}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
