"""A user's training script with its own DataLoader worker processes (fork, the Linux default), using
torchlaunch.api for the agreed preemption and exact resume: what a stop from outside must not break.

    python -m launch.local --gpus 2 --run-dir R -- tests/programs/loader_workers.py --run-dir R --epochs 3
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchlaunch import api


class Noisy(torch.utils.data.Dataset):
    """A two-class problem read one sample at a time in the loader's worker processes."""

    def __init__(self, seed: int, n: int = 1024) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :4].sum(1) + 0.5 * torch.randn(n, generator=g) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    data = Noisy(0)
    with api.setup() as ctx:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)).to(ctx.device)
        net = DistributedDataParallel(model) if ctx.world_size > 1 else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = api.resumable_sampler(len(data), 32, 0)
        total = sampler.steps_per_epoch * args.epochs
        ckpt = api.Checkpointer(args.run_dir, keep=2)
        state = ckpt.load_latest()
        step = 0
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = ckpt.step
        while step < total:
            epoch, start = sampler.locate(step)
            batches = [idx.tolist() for _, idx in sampler.batches(epoch, start)]
            loader = torch.utils.data.DataLoader(data, batch_sampler=batches, num_workers=args.workers)
            for x, y in loader:
                loss = nn.functional.cross_entropy(net(x.to(ctx.device)), y.to(ctx.device))
                optimizer.zero_grad()
                (loss * sampler.loss_weight).backward()
                optimizer.step()
                step += 1
                if ctx.is_main:
                    print(f"step {step}/{total} loss {loss.item():.4f}", flush=True)
                if api.preemption_requested():
                    ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
                    sys.exit(api.PREEMPTED)
        ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, synchronous=True)
        if ctx.is_main:
            torch.save(model.state_dict(), args.run_dir / ".model.pt.tmp")
            os.replace(args.run_dir / ".model.pt.tmp", args.run_dir / "model.pt")
            print(f"finished: {step} steps", flush=True)
    return api.OK


if __name__ == "__main__":
    sys.exit(main())
