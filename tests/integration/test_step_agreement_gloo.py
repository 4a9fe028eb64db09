"""The per-step preemption agreement (core/preemption.py StepAgreement) over a real gloo group:
one rank's flag stops every rank at the same step, `lag` steps later or at the check point before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import leave_spawned_rank
from torchlaunch.core.dist import DistContext
from torchlaunch.core.preemption import StepAgreement
from torchlaunch.worker.schedule import LoopSchedule

SIGNALLED_AT = 4  # rank 1 sees its signal after step 4; rank 0 never does
CASES = {
    "no check point": LoopSchedule(steps_per_epoch=100, epochs=1, total_steps=100, log_every=50, agreement_lag=2),
    "check point first": LoopSchedule(steps_per_epoch=100, epochs=1, total_steps=100, log_every=5, agreement_lag=2),
    "no lag": LoopSchedule(steps_per_epoch=100, epochs=1, total_steps=100, log_every=50, agreement_lag=0),
}


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, backend="gloo")
    stops = {}
    for name, schedule in CASES.items():
        agreement = StepAgreement(ctx)
        for step in range(1, 20):
            agreement.post(step, requested=rank == 1 and step >= SIGNALLED_AT)
            check = schedule.after_step(step, step).check
            stop = agreement.read(schedule.agreement_through(step, check))
            if stop:
                agreement.drain()
                stops[name] = step
                break
        assert not agreement.drain()  # nothing left in flight
    Path(out, f"rank{rank}.json").write_text(json.dumps(stops))
    dist.barrier()
    dist.destroy_process_group()
    leave_spawned_rank()


@pytest.mark.slow  # two spawned processes, each importing torch
def test_every_rank_stops_at_the_same_step(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, join=True)
    stops = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert stops[0] == stops[1] == {"no check point": 6, "check point first": 5, "no lag": 4}


def test_the_store_host_leaves_only_after_every_peer_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 hosts the TCPStore (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): when it exited first, a peer
    still in destroy_process_group lost the store under a C++ thread ("terminate called without an
    active exception"). The host now waits for every peer's word, bounded when a peer never comes."""
    from datetime import timedelta

    import torch.distributed as tdist

    from torchlaunch.core import dist as core_dist

    host = tdist.TCPStore("127.0.0.1", 0, 3, True, timedelta(seconds=30), wait_for_workers=False)
    peer = tdist.TCPStore("127.0.0.1", host.port, 3, False, timedelta(seconds=30))
    core_dist.leave_after_peers(peer, 1, 2)
    assert host.check(["torchlaunch/left/1"])
    core_dist.leave_after_peers(host, 0, 2)  # returns: its one peer has left
    monkeypatch.setattr(core_dist, "LEAVE_TIMEOUT_S", 0.2)
    core_dist.leave_after_peers(host, 0, 3)  # rank 2 never says it left (died): not waited for forever
    assert not host.check(["torchlaunch/left/2"])
