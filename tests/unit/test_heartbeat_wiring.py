"""The heartbeat is wired: the built-in trainer and the API's per-step call leave RUN_DIR/progress/rank-N.json.

The launcher's `status` and hang watchdog read these files (torchlaunch/jobs/progress.py); a step that
never reports would leave a healthy run looking hung. The trainer's beat carries its step, total,
epoch and the per-rank batch, all Python ints (test_host_sync.py checks that no device read was added).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_host_sync import _trainer
from torchlaunch import api
from torchlaunch.exit_codes import OK
from torchlaunch.jobs import progress


@pytest.fixture
def progress_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "progress"
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(where))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(progress, "_writer", None)
    return where


def _beat(where: Path) -> progress.RankBeat:
    beats, problems = progress.read_all(where)
    assert problems == [] and len(beats) == 1, (beats, problems)
    return beats[0]


def test_trainer_fit_heartbeats(tmp_path: Path, progress_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK")  # the trainer runs without a process group here
    trainer = _trainer(tmp_path / "run", torch.device("cpu"))
    assert trainer.fit() == OK
    beat = _beat(progress_dir)
    assert beat.rank == 0 and beat.total == trainer.total_steps == 12
    assert beat.step is not None and 1 <= beat.step <= 12 and beat.epoch in (0, 1)


def test_trainer_beats_every_step_when_the_interval_allows(
    tmp_path: Path, progress_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK")
    trainer = _trainer(tmp_path / "run", torch.device("cpu"))
    progress._writer = progress.Heartbeat(progress_dir, 0, interval_s=0.0)
    assert trainer.fit() == OK
    beat = _beat(progress_dir)
    assert beat.step == 12 and beat.epoch == 1 and beat.beat == 12


def test_api_preemption_requested_heartbeats(progress_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("RANK")
    progress._writer = progress.Heartbeat(progress_dir, 0, interval_s=0.0)
    with api.setup():
        assert api.preemption_requested(7) is False
        assert _beat(progress_dir).step == 7
        assert api.preemption_requested() is False  # no step given: the number of calls so far
        assert _beat(progress_dir).step == 2


def test_api_reexports_heartbeat(progress_dir: Path) -> None:
    progress._writer = progress.Heartbeat(progress_dir, 0, interval_s=0.0)
    api.heartbeat(3, total=10, epoch=0)
    beat = _beat(progress_dir)
    assert (beat.step, beat.total, beat.epoch) == (3, 10, 0)
    assert api.heartbeat is progress.heartbeat
