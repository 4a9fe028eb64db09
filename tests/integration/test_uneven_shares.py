"""Uneven per-rank shares (a world size that does not divide the global batch): real DDP on gloo in 3
processes takes the same optimizer steps as one process over the whole batch, up to float summation
order, through the trainer's own accumulation code (worker/accumulate.py) and the batch plan.

The model has no BatchNorm (GroupNorm), because BatchNorm normalises over each rank's own micro-batch:
with it no world size change (even or uneven) can give the same step. It registers a buffer, so DDP
broadcasts buffers in each step's first forward: the micro-steps a rank skips (train.micro_batch_size=1
leaves an empty one on the smaller shares) must not put the ranks' collectives out of step."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import leave_spawned_rank
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.worker.accumulate import backward_share

N, STEPS, SEED = 192, 2, 7
CASES = [(64, 0), (64, 8), (4, 1)]  # (global batch, micro_batch_size) on 3 ranks: 22/21/21 and 2/1/1
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
"""float32 weights after two SGD steps: what a different summation order (3 partial sums averaged by
DDP instead of one sum) can change. Measured: the largest difference is 0.04 of this bound; without the
count weighting (a mean of the ranks' means) the cases exceed it 300x to 20000x."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.head = nn.Linear(8, 5)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += len(x)
        return self.head(self.body(x))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(N, 3, 8, 8, generator=g), torch.randint(0, 5, (N,), generator=g)


def train(rank: int, world: int, batch: int, micro: int, ddp: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """STEPS optimizer steps of the plan on this rank; the weights and each step's loss value."""
    torch.manual_seed(SEED)
    model = Net()
    net: nn.Module = DistributedDataParallel(model) if ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    plan = BatchPlan(N, batch, SEED, rank, world, micro)
    x, y = data()
    perm = plan.permutation(0)
    losses = []
    for step in range(STEPS):
        idx = plan.rank_step(perm, 0, step)[0]
        sizes = plan.micro_sizes()
        micro_batches = list(zip(x[idx].split(sizes), y[idx].split(sizes), strict=True))
        total = backward_share(net, micro_batches, criterion, plan, scaler, contextlib.nullcontext)
        if ddp:
            dist.all_reduce(total)
        losses.append(float(total) / world)  # the trainer's log: sum over ranks / W = the global mean
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "seen"}, losses


def _rank(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for batch, micro in CASES:
            weights, losses = train(rank, world, batch, micro, ddp=True)
            if rank == 0:
                torch.save(weights, Path(out, f"{batch}-{micro}.pt"))
                Path(out, f"{batch}-{micro}.json").write_text(json.dumps(losses))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_spawned_rank()


@pytest.mark.slow  # three spawned processes: their start-up is most of its time
def test_three_uneven_ranks_take_the_one_rank_step(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(3, str(tmp_path / "store"), str(tmp_path)), nprocs=3, start_method="spawn")
    for batch, micro in CASES:
        assert len(set(BatchPlan(N, batch, SEED, 0, 3).shares)) == 2  # uneven on 3 ranks
        want, want_losses = train(0, 1, batch, micro, ddp=False)
        got = torch.load(tmp_path / f"{batch}-{micro}.pt", weights_only=True)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.allclose(got[key], want[key], **TOLERANCE), (batch, micro, key)
        torch.manual_seed(SEED)
        start = {k: v for k, v in Net().state_dict().items() if k != "seen"}
        assert any(not torch.allclose(want[k], start[k], **TOLERANCE) for k in want)  # the steps moved it
        losses = json.loads((tmp_path / f"{batch}-{micro}.json").read_text())
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want_losses, strict=True)), (losses, want_losses)
