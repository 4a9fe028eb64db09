"""test_checkpoint_place_worker: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_checkpoint_place.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch.exit_codes import BAD_INPUT


@pytest.mark.slow
def test_a_symlinked_checkpoints_folder_exits_2_through_the_worker(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(tmp_path / "elsewhere")
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", "configs/smoke.yaml", f"run_dir={run}", "train.max_steps=1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == BAD_INPUT, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "is a symlink to" in errors[0], proc.stderr[-3000:]
