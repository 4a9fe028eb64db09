"""No training step reads the device between check points.

A read of a device tensor on the host (`.item()`, `float()`, `.tolist()`, `.cpu()`, `bool()`, ...)
waits for every kernel queued before it: once per step, the GPU idles while the host catches up.
The real Trainer.fit runs a few epochs here with those methods recording every call; calls are
allowed only inside the check points (the agreed loss sum, validation, checkpoints, resume, and
the start-up figure of the first step). On a GPU the same run also runs under
torch.cuda.set_sync_debug_mode("error"), which catches reads torch makes internally.

Progress reporting is in the recorded path too: with a heartbeat written on every step (a launcher's
TORCHLAUNCH_PROGRESS_DIR set, interval 0), fit() still reads the device only at check points, and a
heartbeat fed a device tensor (the negative control) is caught at its first beat of every step.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchlaunch import config as config_mod
from torchlaunch.core.dist import DistContext
from torchlaunch.core.preemption import PreemptionWatcher
from torchlaunch.exit_codes import OK
from torchlaunch.jobs import progress
from torchlaunch.worker import loop
from torchlaunch.worker.data import load_bundle
from torchlaunch.worker.trainer import Trainer

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
CHECK_POINTS = (
    "_agreed_loss_sum",
    "evaluate",
    "save",
    "resume",
    "_startup_seconds",
    "_warn_lead_time",
    "_publish_final_model",
    "_preempted",
)
"""Trainer methods that may read the device: each runs at a check point, or once per process."""


def _trainer(run_dir: Path, device: torch.device) -> Trainer:
    cfg = config_mod.load(
        None,
        [
            f"run_dir={run_dir}",
            "model.name=simple_cnn",
            "model.width=4",
            "data.name=synthetic",
            "data.synthetic_train_size=96",  # 6 steps per epoch
            "data.synthetic_val_size=16",
            "train.batch_size=16",
            "train.epochs=2",
            "train.log_every_steps=4",
            "train.precision=fp32",
            "checkpoint.every_steps=5",
            "checkpoint.async_save=false",
            "debug.check_model=false",
        ],
    )
    return Trainer(cfg, DistContext(device=device), load_bundle(cfg.data), PreemptionWatcher([]))


class Recorder:
    """Patches the host-read methods of torch.Tensor; records those made outside a check point."""

    def __init__(self) -> None:
        self.depth = 0
        self.allowed = 0
        self.outside: list[str] = []
        self.active = False

    def _read(self, name: str, original):  # noqa: ANN001, ANN202
        recorder = self

        @functools.wraps(original)
        def read(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
            if recorder.active:
                if recorder.depth:
                    recorder.allowed += 1
                else:
                    caller = traceback.extract_stack(limit=2)[0]  # the frame that read the tensor
                    recorder.outside.append(f"Tensor.{name} at {caller.filename}:{caller.lineno} ({caller.line})")
            return original(tensor, *args, **kwargs)

        return read

    def _check_point(self, original, on_enter=None, on_exit=None):  # noqa: ANN001, ANN202
        recorder = self

        @functools.wraps(original)
        def check_point(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            recorder.depth += 1
            if on_enter:
                on_enter()
            try:
                return original(*args, **kwargs)
            finally:
                recorder.depth -= 1
                if on_exit and not recorder.depth:
                    on_exit()

        return check_point

    @contextlib.contextmanager
    def patched(self, monkeypatch: pytest.MonkeyPatch, on_enter=None, on_exit=None) -> Iterator[Recorder]:  # noqa: ANN001
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._read(name, getattr(torch.Tensor, name)))
        for name in CHECK_POINTS:
            monkeypatch.setattr(Trainer, name, self._check_point(getattr(Trainer, name), on_enter, on_exit))
        self.active = True
        try:
            yield self
        finally:
            self.active = False


def test_fit_reads_the_device_only_at_check_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(tmp_path / "run", torch.device("cpu"))
    recorder = Recorder()
    with recorder.patched(monkeypatch):
        assert trainer.fit() == OK
    assert trainer.progress.global_step == 12
    assert recorder.outside == []
    assert recorder.allowed > 0  # the check points did read (the loss sums, validation): the patch works


def test_a_read_in_the_step_path_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the pre-fix step (return float(total)) would have been recorded."""
    trainer = _trainer(tmp_path / "run", torch.device("cpu"))
    micro = next(iter(trainer.loader.epoch(0, 0)))[1]
    recorder = Recorder()
    with recorder.patched(monkeypatch):
        loss = trainer.train_step(micro)
        assert isinstance(loss, torch.Tensor) and loss.device == trainer.device and loss.dim() == 0
        assert recorder.outside == []
        float(loss)
    assert len(recorder.outside) == 1 and "Tensor.__float__" in recorder.outside[0]


@pytest.fixture
def beating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A launcher's progress folder and a heartbeat that writes on every step: without it heartbeat()
    returns before Heartbeat.beat runs, and the recorded fit would not exercise the reporting path."""
    where = tmp_path / "progress"
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(where))
    monkeypatch.setattr(progress, "_writer", progress.Heartbeat(where, 0, interval_s=0.0))
    return where


def test_fit_with_heartbeats_reads_the_device_only_at_check_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beating: Path
) -> None:
    trainer = _trainer(tmp_path / "run", torch.device("cpu"))
    recorder = Recorder()
    with recorder.patched(monkeypatch):
        assert trainer.fit() == OK
    beats, problems = progress.read_all(beating)
    assert problems == [] and [(b.step, b.beat) for b in beats] == [(12, 12)]  # written at every one of 12 steps
    assert recorder.outside == []


def test_a_heartbeat_that_reads_the_device_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beating: Path
) -> None:
    """The negative control: a trainer that reported a device tensor (a step counter or the loss kept
    on the device) would make Heartbeat.beat's int() wait for the device on every step."""
    trainer = _trainer(tmp_path / "run", torch.device("cpu"))
    real = loop.heartbeat

    def on_device(step: int, **fields: int | None) -> None:
        real(torch.tensor(step, device=trainer.device), **fields)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "heartbeat", on_device)
    recorder = Recorder()
    with recorder.patched(monkeypatch):
        assert trainer.fit() == OK
    assert len(recorder.outside) == 12 and all("Tensor.__int__" in r for r in recorder.outside), recorder.outside


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.set_sync_debug_mode)")
def test_fit_on_gpu_has_no_sync_between_check_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own synchronisations (blocking copies, .item() inside ops) raise outside check points."""
    device = torch.device("cuda", 0)
    trainer = _trainer(tmp_path / "run", device)
    recorder = Recorder()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with recorder.patched(
            monkeypatch,
            on_enter=lambda: torch.cuda.set_sync_debug_mode(0),
            on_exit=lambda: torch.cuda.set_sync_debug_mode("error"),
        ):
            assert trainer.fit() == OK
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert recorder.outside == []
    assert recorder.allowed > 0
