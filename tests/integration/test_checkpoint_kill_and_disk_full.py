"""test_checkpoint_kill_and_disk_full: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.unit.test_checkpoint import CRASH_WRITER, FINAL_SAVE_FAILS, state
from torchlaunch.core import checkpoint as ckpt


def test_kill_9_in_the_middle_of_a_write_keeps_previous(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, 1, state(1), {})
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_WRITER, str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline_checks = 0
        while not (tmp_path / "IN_PROGRESS").exists():
            assert proc.poll() is None, "writer exited before reaching the commit point"
            deadline_checks += 1
            assert deadline_checks < 600, "writer never reached the commit point"
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        in_progress = Path((tmp_path / "IN_PROGRESS").read_text())
        assert (in_progress / ckpt.STATE_FILE).is_file()  # the write is provably under way
        proc.kill()
    finally:
        proc.wait(timeout=30)
    path, loaded = ckpt.find_latest(tmp_path)
    assert path.name == "step-000000001" and loaded["step"] == 1
    removed = ckpt.clean_stale(tmp_path)
    assert in_progress in removed
    assert ckpt.write_checkpoint(tmp_path, 2, state(2), {}).path.name == "step-000000002"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a tmpfs needs root")
def test_real_disk_full_on_a_small_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if rc.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {rc.stderr.decode().strip()}")
    try:
        ckpt.write_checkpoint(mnt, 1, {"format_version": 1, "w": torch.ones(128, 1024)}, {})  # 512 KiB
        with pytest.raises(ckpt.CheckpointError, match="no space left on device"):
            ckpt.write_checkpoint(mnt, 2, {"format_version": 1, "w": torch.ones(512, 1024)}, {})  # 2 MiB
        path, loaded = ckpt.find_latest(mnt)
        assert path.name == "step-000000001" and torch.equal(loaded["w"], torch.ones(128, 1024))
        assert not [p for p in mnt.iterdir() if p.name.startswith(".")]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_failed_final_checkpoint_leaves_no_model_pt(tmp_path: Path, async_save: str) -> None:
    """model.pt is written while the final checkpoint commits, but appears only once that commit
    succeeded: a failed final save leaves no model.pt (and no temp file), exit 1, and the earlier
    checkpoint intact to resume from."""
    run = tmp_path / "run"
    script = tmp_path / "final_save_fails.py"
    script.write_text(FINAL_SAVE_FAILS.format(final=32))  # smoke: 16 steps per epoch, 2 epochs
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--config",
            "configs/smoke.yaml",
            f"run_dir={run}",
            "train.epochs=2",
            "checkpoint.every_steps=0",
            "checkpoint.every_epochs=1",
            f"checkpoint.async_save={async_save}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "injected: no space left on device" in out.stderr
    assert not (run / "model.pt").exists() and not (run / ".model.pt.tmp").exists()
    path, loaded = ckpt.find_latest(run / "checkpoints")
    assert path.name == "step-000000016" and loaded["progress"]["global_step"] == 16
