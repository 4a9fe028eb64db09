"""Start-up and per-step overhead, and the async-save snapshot buffers.

- the optimizers that skip torch._dynamo's import update, save and load bit for bit like torch's;
- a real worker never imports torch._dynamo and reports `startup_s`;
- a NaN loss still stops the run with exit 2 within NAN_CHECK_BOUND, before any checkpoint;
- Lookahead's foreach update equals the per-tensor one bit for bit;
- a snapshot taken into reused buffers is written with the bytes of its own step, never a later one.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from torchlaunch.core import checkpoint as ckpt
from torchlaunch.worker import optim as optim_mod
from torchlaunch.worker.lookahead import Lookahead


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x, y = torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_dynamo_free_optimizer_matches_torch_bit_for_bit(name: str) -> None:
    ours, theirs = _net(), None
    ours(torch.zeros(1, 3, 8, 8))  # materialise the lazy layer before copying
    theirs = copy.deepcopy(ours)

    def groups(m):
        return [
            {"params": list(m.parameters())[:2], "weight_decay": 5e-4},
            {"params": list(m.parameters())[2:], "lr": 0.05, "weight_decay": 0.0},
        ]

    kw = {"lr": 0.1, "weight_decay": 5e-4}
    if name == "sgd":
        opt_a = optim_mod.build(
            "sgd", groups(ours), torch.device("cpu"), eager_only=True, momentum=0.9, nesterov=True, **kw
        )
        opt_b = torch.optim.SGD(groups(theirs), momentum=0.9, nesterov=True, fused=True, **kw)
    else:
        opt_a = optim_mod.build("adamw", groups(ours), torch.device("cpu"), eager_only=True, **kw)
        opt_b = torch.optim.AdamW(groups(theirs), **kw)
    assert type(opt_a).__module__ == "torchlaunch.worker.optim"
    _steps(ours, opt_a, 3)
    _steps(theirs, opt_b, 3)
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sb["state"]:
        for key, value in sb["state"][k].items():
            assert torch.equal(sa["state"][k][key], value), (k, key)
    # A resumed optimizer continues identically: load torch's state into ours and step both on.
    resumed = copy.deepcopy(theirs)
    opt_c = (
        optim_mod.build(name, groups(resumed), torch.device("cpu"), eager_only=True, momentum=0.9, nesterov=True, **kw)
        if name == "sgd"
        else optim_mod.build(name, groups(resumed), torch.device("cpu"), eager_only=True, **kw)
    )
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))  # as from a file: no aliasing
    _steps(resumed, opt_c, 2)
    _steps(theirs, opt_b, 2)
    for a, b in zip(resumed.state_dict().values(), theirs.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_lookahead_foreach_equals_per_tensor_update() -> None:
    model = _net()
    model(torch.zeros(1, 3, 8, 8))
    reference = copy.deepcopy(model)
    la = Lookahead(model, every=2, decay=0.7, total_steps=6)
    avg = {k: v.detach().clone() for k, v in reference.state_dict().items() if v.is_floating_point()}
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 7):
        with torch.no_grad():
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                delta = torch.randn(a.shape, generator=gen)
                a.add_(delta)
                b.add_(delta)
        la.after_step(step)
        if step % 2 == 0 or step >= 6:
            keep = 1.0 if step >= 6 else 0.7 * (step / 6) ** 3
            with torch.no_grad():
                for key, live in reference.state_dict().items():
                    if live.is_floating_point():
                        avg[key].lerp_(live, 1.0 - keep)
                        live.copy_(avg[key])
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_snapshot_buffers_are_reused_and_refused_while_written() -> None:
    live = {"w": torch.zeros(4, 3), "nested": [{"m": torch.ones(5)}], "step": 0}
    pool = ckpt.SnapshotBuffers(sets=2)
    first = pool.take(live)
    second = pool.take(live)
    assert first.state["w"].data_ptr() != second.state["w"].data_ptr()
    with pytest.raises(TimeoutError):  # set 1 is still held by the write of `first`
        pool.take(live, timeout_s=0)
    first.release()
    third = pool.take(live)
    assert third.state["w"].data_ptr() == first.state["w"].data_ptr()  # the same pages, refilled
    assert third.state["nested"][0]["m"].data_ptr() == first.state["nested"][0]["m"].data_ptr()
    second.release()
    third.release()


def test_each_async_save_holds_its_own_steps_bytes(tmp_path: Path) -> None:
    """Write k is held open until snapshot k+1 exists (the live tensors already changed twice): a
    single reused buffer would have been overwritten under it; each file must still hold step k."""
    live = {"model": {"w": torch.zeros(64, 64)}, "format_version": ckpt.FORMAT_VERSION}
    pool, writer = ckpt.SnapshotBuffers(), ckpt.AsyncWriter()
    next_taken = [threading.Event() for _ in range(8)]
    root = tmp_path / "checkpoints"

    def job(step: int, snap: ckpt.Snapshot):
        def write(state):
            assert next_taken[step].wait(60), "the next snapshot was never taken"
            return ckpt.write_checkpoint(root, step, state, {})

        return lambda: snap.write_with(write)

    for step in range(1, 7):
        live["model"]["w"].fill_(float(step))
        snap = pool.take(live)
        next_taken[step - 1].set()  # the previous write may go on only now
        live["model"]["w"].fill_(-1.0)  # training moves on before the write happens
        writer.submit(job(step, snap))
    next_taken[6].set()
    writer.wait()
    for step in range(1, 7):
        state = ckpt.load_state(root / ckpt.step_dir_name(step))
        assert torch.equal(state["model"]["w"], torch.full((64, 64), float(step))), step


def test_trainer_async_save_commits_the_step_it_was_asked_for(tmp_path: Path) -> None:
    """Through Trainer.save: two async saves in a row, training in between; each checkpoint holds
    the weights of its own step (the reused buffers alternate between the two writes)."""
    from bench.harness import make_trainer

    trainer = make_trainer(
        [
            "model.name=simple_cnn",
            "model.width=4",
            "data.name=synthetic",
            "data.synthetic_train_size=64",
            "data.synthetic_val_size=16",
            "train.batch_size=16",
            "train.precision=fp32",
            f"run_dir={tmp_path / 'run'}",
            "checkpoint.keep=5",
        ]
    )
    batches = trainer.loader.epoch(0, 0)
    expected = {}
    for _ in range(3):
        trainer.train_step(next(batches)[1])
        trainer.progress.global_step += 1
        trainer.progress.step_in_epoch += 1
        expected[trainer.progress.global_step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.save(synchronous=False)
    trainer.writer.wait()
    for step, want in expected.items():
        got = ckpt.load_state(trainer.ckpt_root / ckpt.step_dir_name(step))["model"]
        assert all(torch.equal(got[k], v) for k, v in want.items()), step
