"""test_runlock: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_runlock_processes.py.
"""

from __future__ import annotations

import json
import os

from tests.integration.test_runlock_processes import refusal
from torchlaunch import runlock


def test_free_run_dir_is_taken_and_released(tmp_path):
    lock = runlock.acquire(tmp_path / "run", command=["python", "-m", "launch.local"])
    record = json.loads((tmp_path / "run" / runlock.LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == runlock.socket.gethostname()
    assert record["pid_start"] == runlock.pid_start_time(os.getpid()) is not None
    assert record["command"] == ["python", "-m", "launch.local"]
    lock.release()
    assert not (tmp_path / "run" / runlock.LOCK_NAME).exists()


def test_hand_over_keeps_the_lock_for_the_scheduler_job(tmp_path):
    lock = runlock.acquire(tmp_path)
    lock.hand_over("slurm", "77")
    lock.release()  # the launcher exits: the job keeps the run dir
    record = json.loads((tmp_path / runlock.LOCK_NAME).read_text())
    assert (record["scheduler"], record["job_id"], record["token"]) == ("slurm", "77", lock.holder.token)
    assert "slurm job 77" in refusal(tmp_path, job_alive=lambda s, j: True)


def test_finished_scheduler_job_releases_only_its_own_lock(tmp_path):
    lock = runlock.acquire(tmp_path)
    lock.hand_over("slurm", "77")
    assert not runlock.release_for_job(tmp_path, "slurm", "78")
    assert (tmp_path / runlock.LOCK_NAME).exists()
    assert runlock.release_for_job(tmp_path, "slurm", "77")
    assert not (tmp_path / runlock.LOCK_NAME).exists()


def test_unreadable_lock_is_live_and_named(tmp_path):
    (tmp_path / runlock.LOCK_NAME).write_text("{half a rec")
    assert "cannot be read" in refusal(tmp_path)
