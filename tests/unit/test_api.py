"""train/api.py, the public API for user scripts, and examples/custom_loop.py built on it.

Unit tests run the API in this process (no launcher: a single process without a process group);
the end-to-end tests run the example as a real subprocess and under real torchrun, interrupt it with
a real SIGTERM at a seeded step, rerun it and compare the final weights bit for bit.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO, run_cmd, torchrun_argv
from tests.stops import Launch
from torchlaunch import api
from torchlaunch.core import checkpoint as ckpt

EXAMPLE = str(REPO / "examples" / "custom_loop.py")
SEEDED = random.Random(14)


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> Iterator[api.Context]:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    ctx = api.setup()
    try:
        yield ctx
    finally:
        api.teardown()


def user_state(seed: int) -> dict:
    """What a user script saves: module and optimizer state_dicts, nested dicts, numbers."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "lr": 0.25,
        "extra": {"history": [1.5, 2.5], "ids": torch.arange(5)},
    }


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


# ------------------------------------------------------------------ setup / Checkpointer


def test_setup_without_launcher_is_one_process(session: api.Context) -> None:
    assert (session.rank, session.world_size, session.local_rank, session.is_main) == (0, 1, 0, True)
    assert not session.distributed
    assert api.setup() is session  # a second call is the same session


def test_checkpointer_needs_setup() -> None:
    with pytest.raises(RuntimeError, match="setup"):
        api.Checkpointer("/tmp/never-created")


def test_save_then_load_latest_round_trips_state(session: api.Context, tmp_path: Path) -> None:
    checkpointer = api.Checkpointer(tmp_path)
    assert checkpointer.load_latest() is None and checkpointer.step is None
    state = user_state(0)
    checkpointer.save(7, state)
    checkpointer.wait()
    assert ckpt.verify(tmp_path / "checkpoints" / "step-000000007") is None
    loaded = api.Checkpointer(tmp_path).load_latest()
    assert_same(state, loaded)


def test_async_save_snapshots_the_state_at_the_call(session: api.Context, tmp_path: Path) -> None:
    checkpointer = api.Checkpointer(tmp_path)
    weights = torch.zeros(1000)
    checkpointer.save(1, {"w": weights})
    weights.add_(1.0)  # training goes on while the commit runs
    checkpointer.wait()
    fresh = api.Checkpointer(tmp_path)
    assert torch.equal(fresh.load_latest()["w"], torch.zeros(1000)) and fresh.step == 1


def test_corrupt_newest_falls_back_with_warning(
    session: api.Context, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpointer = api.Checkpointer(tmp_path, synchronous=True)
    checkpointer.save(1, {"v": torch.tensor([1.0])})
    checkpointer.save(2, {"v": torch.tensor([2.0])})
    newest = tmp_path / "checkpoints" / "step-000000002" / ckpt.STATE_FILE
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    fresh = api.Checkpointer(tmp_path)
    state = fresh.load_latest()
    assert fresh.step == 1 and torch.equal(state["v"], torch.tensor([1.0]))
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step-000000002" in err and "checksum mismatch" in err


def test_retention_keeps_newest_two(session: api.Context, tmp_path: Path) -> None:
    checkpointer = api.Checkpointer(tmp_path, keep=2)
    for step in range(1, 6):
        checkpointer.save(step, {"step": step})
    checkpointer.wait()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000000004", "step-000000005"]


def test_load_latest_restores_every_rng(session: api.Context, tmp_path: Path) -> None:
    checkpointer = api.Checkpointer(tmp_path, synchronous=True)
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    checkpointer.save(1, {})

    def draws() -> tuple:
        return torch.rand(3), np.random.rand(3).tolist(), random.random()

    expected = draws()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    api.Checkpointer(tmp_path).load_latest()
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_checkpoints_of_the_builtin_worker_are_refused(session: api.Context, tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path / "checkpoints", 3, {"format_version": ckpt.FORMAT_VERSION, "model": {}}, {})
    with pytest.raises(api.BadInput, match="not written by api.Checkpointer"):
        api.Checkpointer(tmp_path).load_latest()


def test_keep_below_one_is_bad_input(session: api.Context, tmp_path: Path) -> None:
    with pytest.raises(api.BadInput, match="keep=0"):
        api.Checkpointer(tmp_path, keep=0)


def run_snippet(code: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return run_cmd([sys.executable, "-c", textwrap.dedent(code)], timeout=120, env=env)


# ------------------------------------------------------------------ preemption flag


def test_preemption_flag_follows_a_real_signal(session: api.Context) -> None:
    assert api.preemption_requested() is False
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode of this thread
    assert api.preemption_requested() is True
    assert api.PREEMPTED == 75


def test_teardown_restores_signal_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    api.setup()
    assert signal.getsignal(signal.SIGTERM) is not before
    api.teardown()
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------------ sampler


def test_sampler_is_a_pure_function_of_seed_epoch_step() -> None:
    a = api.resumable_sampler(100, 8, seed=5)
    b = api.resumable_sampler(100, 8, seed=5)
    other = api.resumable_sampler(100, 8, seed=6)
    assert a.steps_per_epoch == 12 and a.batch_size == 8
    first = [idx.tolist() for _, idx in a.batches(0)]
    assert first == [idx.tolist() for _, idx in b.batches(0)]
    assert first != [idx.tolist() for _, idx in other.batches(0)]
    assert first != [idx.tolist() for _, idx in a.batches(1)]  # a new permutation per epoch
    flat = [i for batch in first for i in batch]
    assert len(set(flat)) == len(flat) == 96  # no sample twice in an epoch, the partial batch dropped


def test_sampler_resume_continues_the_same_order() -> None:
    sampler = api.resumable_sampler(100, 8, seed=5)
    full = [(s, idx.tolist()) for s, idx in sampler.batches(2)]
    k = SEEDED.randrange(1, sampler.steps_per_epoch)
    assert [(s, idx.tolist()) for s, idx in sampler.batches(2, k)] == full[k:]
    assert sampler.locate(2 * sampler.steps_per_epoch + k) == (2, k)


def test_sampler_ranks_share_the_global_batch() -> None:
    whole = [idx.tolist() for _, idx in api.resumable_sampler(100, 8, 5).batches(0)]
    ranks = [
        [idx.tolist() for _, idx in api.resumable_sampler(100, 8, 5, rank=r, world_size=2).batches(0)] for r in range(2)
    ]
    assert [r0 + r1 for r0, r1 in zip(*ranks, strict=True)] == whole


def test_sampler_uneven_shares_and_the_loss_weight_that_keeps_the_global_mean() -> None:
    """3 ranks of a batch of 8: shares 3/3/2 that concatenate to the 1-rank batches; each rank's mean
    loss weighted by loss_weight (share * W / B) and averaged over W is the global batch's mean."""
    whole = [idx.tolist() for _, idx in api.resumable_sampler(100, 8, 5).batches(0)]
    samplers = [api.resumable_sampler(100, 8, 5, rank=r, world_size=3) for r in range(3)]
    assert [s.batch_size for s in samplers] == [3, 3, 2] and samplers[0].shares == (3, 3, 2)
    parts = [[idx.tolist() for _, idx in s.batches(0)] for s in samplers]
    assert [a + b + c for a, b, c in zip(*parts, strict=True)] == whole
    assert [s.loss_weight for s in samplers] == [9 / 8, 9 / 8, 6 / 8]
    assert api.resumable_sampler(100, 8, 5, rank=1, world_size=4).loss_weight == 1.0
    values = torch.arange(8, dtype=torch.float64)  # per-sample losses of one global batch
    shares = torch.split(values, list(samplers[0].shares))
    averaged = sum(part.mean() * s.loss_weight for part, s in zip(shares, samplers, strict=True)) / 3
    assert torch.isclose(averaged, values.mean())


@pytest.mark.parametrize(
    "n,batch,world,needle",
    [(100, 3, 4, "at least the world size 4"), (5, 8, 1, "dataset_len=5"), (100, 0, 1, "batch_size=0")],
)
def test_sampler_bad_sizes_are_bad_input(n: int, batch: int, world: int, needle: str) -> None:
    with pytest.raises(api.BadInput, match=needle):
        api.resumable_sampler(n, batch, 0, rank=0, world_size=world)


# ------------------------------------------------------------------ examples/custom_loop.py end to end


def run_example(run_dir: Path, epochs: int, torchrun: bool = False) -> tuple[int, str, str]:
    return run_cmd(example_argv(run_dir, epochs, torchrun), timeout=300)


def example_argv(run_dir: Path, epochs: int, torchrun: bool) -> list[str]:
    args = [EXAMPLE, "--run-dir", str(run_dir), "--epochs", str(epochs)]
    return torchrun_argv(2, *args) if torchrun else [sys.executable, *args]


def sigterm_at_step(run_dir: Path, epochs: int, step: int, torchrun: bool = False) -> tuple[int, str]:
    """Start the example, send SIGTERM to it (or to torchrun) when its output shows `step N/`."""
    with Launch(example_argv(run_dir, epochs, torchrun), stderr=subprocess.STDOUT) as launch:
        seen = launch.read_until(f"step {step}/")
        launch.deliver("pid", signal.SIGTERM)
        code, out, _ = launch.finish()
    return code, "".join(seen) + out


def committed_steps(run_dir: Path) -> list[int]:
    return [step for step, p in ckpt.candidates(run_dir / "checkpoints") if ckpt.verify(p) is None]


LAGGED = """
import json, os, signal, sys
from torchlaunch import api

ctx = api.setup(signals=("SIGUSR1",))
answers = []
for call in range(1, 13):
    if call == 5 and ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # flag-only handler: rank 1 alone asks to stop
    answers.append(api.preemption_requested(call))
with open(os.path.join(sys.argv[1], f"rank{ctx.rank}.json"), "w") as f:
    json.dump(answers, f)
api.teardown()
sys.exit(api.PREEMPTED)
"""


SLOW_START = """
import os, sys, time
import torch
import torch.distributed as dist
from torchlaunch import api

rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(4)  # a rank that starts late (a node importing from a shared filesystem)
ctx = api.setup(timeout_s=2)
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {ctx.rank} joined: {t.item():.0f}", flush=True)
if rank == 1:
    time.sleep(4)  # now a peer that stops answering
dist.all_reduce(t)
"""


def test_step_drop_lets_a_loop_drop_the_step_in_flight_on_a_stop(session: api.Context) -> None:
    """Issue #53: a user's loop gets the trainer's helper; a stop seen before the next micro-batch drops
    the step, and what the step moved (BatchNorm statistics, torch's RNG) is put back for the save."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    drop = api.step_drop(model)
    drop.begin(1)
    before = [b.clone() for b in model.buffers()]
    assert not drop.leave()
    model(torch.rand(8, 2) * 3)
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode of this thread
    assert drop.leave() and drop.agreed()
    drop.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))
