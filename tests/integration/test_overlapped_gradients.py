"""A live group's gradient averaging overlapped with backward (live/grads.OverlappedGradients),
over a real gloo group of two spawned ranks: the buckets are posted from backward's hooks, the result is
the flat all-reduce's bit for bit, a parameter one rank leaves unused holds nobody up, and a lost peer
fails the step's wait after backward, not backward itself."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.helpers import leave_spawned_rank
from torchlaunch.live.failure import is_peer_lost
from torchlaunch.live.grads import FlatGradients, OverlappedGradients

pytestmark = pytest.mark.slow  # two spawned processes, each importing torch


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.Linear(32, 10)
    )


class WithSpare(nn.Module):
    """A model whose `spare` layer only rank 0 uses: its gradient is accumulated on one rank alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spare = nn.Linear(10, 10)  # registered first: the buffer's last bucket
        self.body = _model()

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        out = self.body(x)
        return self.spare(out) if use_spare else out


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(100 + rank)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    result: dict[str, object] = {}

    # the flat all-reduce after backward: the reference
    model = WithSpare()
    flat = FlatGradients(model.parameters())
    nn.functional.cross_entropy(model(x, use_spare=rank == 0), y).backward()
    dist.all_reduce(flat.flat)
    flat.flat.div_(2)
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}

    model = WithSpare()
    grads = OverlappedGradients(model.parameters(), first_bucket_bytes=256, bucket_bytes=512)
    result["buckets"] = len(grads.buckets)
    for step in range(2):  # twice: a step's state is its own
        grads.zero()
        grads.arm()
        nn.functional.cross_entropy(model(x, use_spare=rank == 0), y).backward()
        result[f"posted_in_backward_{step}"] = len(grads._works)
        grads.finish(2)
        result[f"equal_{step}"] = all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters())

    # a peer lost mid-step: rank 1 ends before its backward; rank 0's backward returns, its wait fails
    grads.zero()
    grads.arm()
    if rank == 1:
        Path(out, "rank1.json").write_text(json.dumps(result))
        os._exit(0)
    nn.functional.cross_entropy(model(x, use_spare=True), y).backward()
    result["backward_returned"] = True
    try:
        grads.finish(2)
        result["lost"] = "finish returned"
    except Exception as e:
        result["lost"] = "peer lost" if is_peer_lost(e) else f"other: {str(e).splitlines()[0][:200]}"
    result["works_left"] = len(grads._works)
    Path(out, "rank0.json").write_text(json.dumps(result))
    leave_spawned_rank()


def test_buckets_posted_in_backward_average_as_the_flat_all_reduce_and_a_loss_fails_the_wait(tmp_path: Path) -> None:
    ctx = mp.spawn(_rank, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):  # one rank's end at a time
        assert time.monotonic() < deadline, "the ranks did not end"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["buckets"] > 3
        assert result["equal_0"] and result["equal_1"], "overlapped averaging gave other bits than the flat one"
    # rank 0 posts buckets during backward; rank 1, whose spare layer is unused, posts those before it
    # and leaves the rest to finish(): the same collectives in the same order either way
    assert results[0]["posted_in_backward_0"] == results[0]["buckets"]
    assert 0 < results[1]["posted_in_backward_0"] < results[1]["buckets"]
    assert results[0]["backward_returned"] is True
    assert results[0]["lost"] == "peer lost"
    assert results[0]["works_left"] == 0  # nothing of the broken group is held
