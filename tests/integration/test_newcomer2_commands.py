"""test_newcomer2_commands: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_newcomer2.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.unit.test_newcomer2 import SMOKE, dry_run, write_images
from torchlaunch import config as config_mod
from torchlaunch.base.yaml_file import read_yaml
from torchlaunch.exit_codes import OK


def test_the_loader_worker_warning_is_one_line_of_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchlaunch.core.sampler import BatchPlan
    from torchlaunch.worker.data import ImageSet, Normalizer
    from torchlaunch.worker.data.loaders import TrainLoader

    write_images(tmp_path / "imgs", {"a": 4})
    files = sorted(str(p) for p in (tmp_path / "imgs" / "a").iterdir())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # a pinned rank: one core
    norm = Normalizer((0.5,) * 3, (0.25,) * 3, torch.device("cpu"), channels_last=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loader = TrainLoader(
            ImageSet(labels=torch.zeros(4, dtype=torch.int64), files=files),
            BatchPlan(4, 2, 0, image_size=8),
            norm,
            torch.device("cpu"),
            True,
            3,
            8,
        )
        assert len(list(loader.epoch(0, 0))) == 2
    assert not [w for w in seen if "worker processes" in str(w.message)], [str(w.message) for w in seen]
    assert loader.worker_note is not None and "data.num_workers=3" in loader.worker_note  # above the default (2)
    assert "1 core(s)" in loader.worker_note and "data.num_workers=1" in loader.worker_note


@pytest.mark.timeout(180)
def test_the_dry_run_command_runs_as_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = [
        "data.synthetic_train_size=64",
        "data.synthetic_val_size=32",
        "train.batch_size=32",
        "train.max_steps=2",
        "train.epochs=1",
    ]
    code, out, err = dry_run(["--gpus", "1", "--config", SMOKE, *tiny], tmp_path, capsys)
    assert code == OK, err
    argv = shlex.split(out)
    assert argv[argv.index("--config") + 1] == SMOKE and "train.max_steps=2" in argv
    done = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = config_mod.from_dict(read_yaml(tmp_path / "run" / "config.yaml"))
    assert resolved.train.max_steps == 2 and (tmp_path / "run" / "model.pt").is_file()
