"""A plain PyTorch training loop with torchlaunch's guarantees (coordinated preemption, exact resume).

    python examples/custom_loop.py --run-dir runs/custom                       # one process
    python -m launch.local --gpus 2 -- examples/custom_loop.py --run-dir runs/custom
A preempted run exits 75 after its checkpoint is committed; the same command resumes it, and the
final RUN_DIR/model.pt is bit for bit the one an uninterrupted run writes (on CPU).
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchlaunch import api


def synthetic_data(seed: int, n: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy two-class problem, identical on every rank and every rerun."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :4].sum(1) + 0.5 * torch.randn(n, generator=g) > 0).long()


def main() -> int:
    parser = argparse.ArgumentParser(description="Train a small MLP with torchlaunch.api.")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.run_dir / "model.pt").exists():
        print(f"{args.run_dir / 'model.pt'} exists: the run is finished")
        return api.OK
    with api.setup() as ctx:  # process group (or one process), preemption signal handlers
        x, y = synthetic_data(args.seed)
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2)).to(ctx.device)
        net = DistributedDataParallel(model) if ctx.world_size > 1 else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = api.resumable_sampler(len(x), args.batch_size, args.seed)
        total = sampler.steps_per_epoch * args.epochs
        torch.manual_seed(args.seed + 1 + ctx.rank)  # this rank's dropout stream
        ckpt = api.Checkpointer(args.run_dir, keep=2)
        state = ckpt.load_latest()  # the last call before the loop: it restores this rank's RNG states
        step = 0
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = ckpt.step
            if ctx.is_main:
                print(f"resumed at step {step}", flush=True)
        while step < total:
            epoch, start = sampler.locate(step)
            for _, idx in sampler.batches(epoch, start):
                loss = nn.functional.cross_entropy(net(x[idx].to(ctx.device)), y[idx].to(ctx.device))
                optimizer.zero_grad()
                (loss * sampler.loss_weight).backward()  # 1.0 unless the world size leaves uneven shares
                optimizer.step()
                step += 1
                if ctx.is_main:
                    print(f"step {step}/{total} loss {loss.item():.4f}", flush=True)
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                if api.preemption_requested():  # every rank sees the same answer at the same step
                    ckpt.save(step, state)  # synchronous after a preemption request
                    sys.exit(api.PREEMPTED)
                if step % args.save_every == 0:
                    ckpt.save(step, state)  # committed in the background
        ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, synchronous=True)
        if ctx.is_main:
            torch.save(model.state_dict(), args.run_dir / ".model.pt.tmp")
            os.replace(args.run_dir / ".model.pt.tmp", args.run_dir / "model.pt")
            print(f"finished: {step} steps, model saved to {args.run_dir / 'model.pt'}", flush=True)
    return api.OK


if __name__ == "__main__":
    sys.exit(main())
