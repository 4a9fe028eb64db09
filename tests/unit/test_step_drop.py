"""A stop mid-step drops the step in flight (torchlaunch/core/step_drop.py, issue #53): the same answer
on every rank through the group's store, the step's collectives still run, and nothing of the dropped
step stays in the state a checkpoint takes (buffers, RNG)."""

from __future__ import annotations

import contextlib
import json
from fractions import Fraction
from pathlib import Path

import torch
from torch import nn

from torchlaunch.core.dist import DistContext
from torchlaunch.core.step_drop import StepDrop, applies
from torchlaunch.worker.accumulate import backward_share


class FakeStore:
    """The two calls StepDrop makes of a c10d store, in memory."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.keys[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)


class Flag:
    def __init__(self) -> None:
        self.up = False

    def __call__(self) -> bool:
        return self.up


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))


def test_a_rank_that_leaves_tells_every_peer_through_the_store_before_the_step_syncs() -> None:
    store, flags = FakeStore(), [Flag(), Flag()]
    ranks = [StepDrop(DistContext(rank=r, world_size=2, backend="gloo"), model(), flags[r], store) for r in (0, 1)]
    for drop in ranks:
        drop.begin(5)
    flags[1].up = True
    assert [d.leave() for d in ranks] == [False, True]  # rank 1 says so before its last micro-batch
    assert [d.agreed() for d in ranks] == [True, True]  # after the all-reduce: the same answer on both
    for drop in ranks:
        drop.begin(6)
    assert [d.leave() for d in ranks] == [False, True]  # rank 1's flag stays up: the next step goes too
    assert [d.agreed() for d in ranks] == [True, True]


def test_a_peers_word_makes_a_rank_leave_at_its_next_micro_batch() -> None:
    """A stop that reached one rank only (one pod deleted): its peers leave at their next micro-batch
    instead of running the step's micro-batches to the end before the all-reduce tells them."""
    store, flags = FakeStore(), [Flag(), Flag()]
    ranks = [StepDrop(DistContext(rank=r, world_size=2, backend="gloo"), model(), flags[r], store) for r in (0, 1)]
    for drop in ranks:
        drop.begin(4)
    assert [d.leave() for d in ranks] == [False, False]
    flags[1].up = True
    assert ranks[1].leave() and ranks[0].leave()  # rank 0's flag is down: rank 1's word in the store
    assert [d.agreed() for d in ranks] == [True, True]
    flags[1].up = False
    for drop in ranks:
        drop.begin(5)
    assert [d.leave() for d in ranks] == [False, False]  # a word is one step's: the next one trains


class LostStore(FakeStore):
    """A store whose host is gone (live mode: the group's store is its rank 0's, lost with its node)."""

    def set(self, key: str, value: bytes) -> None:
        raise torch.distributed.DistNetworkError("Failed to recv, got 0 bytes")

    def check(self, keys: list[str]) -> bool:
        raise torch.distributed.DistNetworkError("Failed to recv, got 0 bytes")


def test_a_lost_store_is_no_failure_of_the_check_the_steps_collective_decides() -> None:
    """Node 0 SIGKILLed in live mode took the group's store along: the survivor's check before its next
    micro-batch raised DistNetworkError out of the step (the job ended) instead of letting the step's
    all-reduce fail and the group re-form. The check now says no drop and drops the store for good."""
    flag = Flag()
    drop = StepDrop(DistContext(rank=1, world_size=2, backend="gloo"), model(), flag, LostStore())
    drop.begin(3)
    assert drop.leave() is False and drop.store is None
    assert drop.agreed() is False
    flag.up = True
    drop.begin(4)
    assert drop.leave() is True and drop.agreed() is True  # its own flag still drops the step


def test_a_flag_seen_only_after_the_sync_drops_no_step_on_any_rank() -> None:
    """A rank whose flag came while it was already in the all-reduce finishes the step like its peers."""
    store, flags = FakeStore(), [Flag(), Flag()]
    ranks = [StepDrop(DistContext(rank=r, world_size=2, backend="gloo"), model(), flags[r], store) for r in (0, 1)]
    for drop in ranks:
        drop.begin(3)
        assert not drop.leave()
    flags[0].up = True  # during the synchronised backward: leave() is not asked again this step
    assert [d.agreed() for d in ranks] == [False, False]


def test_a_dropped_step_puts_back_the_buffers_and_the_rng_of_its_start() -> None:
    net, flag = model(), Flag()
    net(torch.rand(2, 3, 6, 6))  # the lazy layer's shape
    drop = StepDrop(DistContext(), net, flag, None)
    drop.begin(1)
    before = [b.clone() for b in net.buffers()]
    expected_draw = torch.rand(3)
    torch.set_rng_state(drop._rng[0])  # noqa: SLF001 - the start's state, as the step saw it
    net.train()
    net(torch.rand(4, 3, 6, 6) * 5)  # the step moves the BatchNorm statistics and draws
    flag.up = True
    assert drop.leave() and drop.agreed()
    drop.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, net.buffers(), strict=True))
    assert torch.equal(torch.rand(3), expected_draw)


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3)
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(len(x))
        return self.lin(x)


class Plan:
    def loss_weight(self, count: int) -> Fraction:
        return Fraction(1, 4)


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.rand(8, 2), torch.randint(0, 3, (8,))) for _ in range(4)]


def run(net: Recorder, leave_from: int, sync_last: bool) -> None:
    asked = iter(range(100))
    backward_share(
        net,
        micro_batches(),
        nn.CrossEntropyLoss(),
        Plan(),  # type: ignore[arg-type]
        torch.amp.GradScaler("cpu", enabled=False),
        contextlib.nullcontext,
        leave=lambda: next(asked) >= leave_from,
        sync_last=sync_last,
    )


def test_leaving_skips_the_micro_batches_left_but_the_synchronised_one_on_two_samples() -> None:
    net = Recorder()
    run(net, leave_from=1, sync_last=True)
    assert net.sizes == [8, 2]  # micro-batch 0, then the last one's collectives at a fraction of its cost
    alone = Recorder()
    run(alone, leave_from=1, sync_last=False)
    assert alone.sizes == [8]  # no peers: nothing more to run
    whole = Recorder()
    run(whole, leave_from=99, sync_last=True)
    assert whole.sizes == [8, 8, 8, 8]


def test_the_drop_applies_on_gloo_and_alone_not_on_nccl() -> None:
    assert applies(DistContext()) and applies(DistContext(backend="gloo"))
    assert not applies(DistContext(backend="nccl"))


def test_a_resume_on_fewer_ranks_cuts_the_absent_ranks_trace_past_the_checkpoint(tmp_path: Path) -> None:
    """2 -> 1: rank 1's file kept the step a stop dropped in flight (step 3 here), which the 1-rank
    resume from step 2 trains again: test_resume found that step's samples twice."""
    from torchlaunch.worker.metrics import RunLog

    kwargs = {"epochs": 1, "steps_per_epoch": 4, "total_steps": 4, "global_batch": 2, "start_step": 0}
    for rank in (0, 1):
        log = RunLog(tmp_path, rank, resume_step=None, tensorboard=False, trace=True, **kwargs)
        for step in (1, 2, 3):
            log.trace(step, 0, 2, [10 * rank + step])
        log.close()
    resumed = RunLog(tmp_path, 0, resume_step=2, tensorboard=False, trace=True, world_size=1, **kwargs)
    resumed.close()
    for rank in (0, 1):
        lines = (tmp_path / "trace" / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2], rank
