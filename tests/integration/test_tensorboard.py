"""Optional TensorBoard: event files beside metrics.jsonl when the package is there, one clear line
(exit 2, before any training) when it is not."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_tensorboard_switch(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "--config",
            "configs/smoke.yaml",
            f"run_dir={tmp_path}",
            "train.tensorboard=true",
            "train.epochs=1",
            "data.synthetic_train_size=256",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    if importlib.util.find_spec("tensorboard") is None:
        assert run.returncode == 2, run.stderr[-2000:]
        lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
        assert lines == [
            "config error: train.tensorboard: the tensorboard package is not installed "
            "(pip install -e '.[tensorboard]', or set train.tensorboard=false)"
        ]
        assert not (tmp_path / "metrics.jsonl").exists()
    else:
        assert run.returncode == 0, run.stderr[-2000:]
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
