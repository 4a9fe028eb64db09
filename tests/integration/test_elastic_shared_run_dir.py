"""test_elastic_shared_run_dir: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_elastic.py.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.unit.test_elastic import member
from torchlaunch import runlock
from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import elastic


def test_launchers_of_one_elastic_job_share_the_run_dir_and_others_are_refused(tmp_path: Path) -> None:
    a, slot_a = member(tmp_path)
    b, slot_b = member(tmp_path)
    try:
        assert (slot_a, slot_b) == (0, 1)  # each node's launcher has its own slot (its job record)
        with pytest.raises(BadInput, match="is in use by pid"):
            runlock.acquire(tmp_path, command=["other"])
        with pytest.raises(BadInput, match="is in use by pid"):
            runlock.acquire(tmp_path, command=["other"], job=elastic.job_key("tl-x", "node0", 29501))
        a.send_signal(signal.SIGKILL)  # the node that wrote the lock is lost: the job goes on
        a.communicate()
        with pytest.raises(BadInput, match="is in use by"):
            runlock.acquire(tmp_path, command=["other"])
        c, slot_c = member(tmp_path)  # the node comes back: the lost node's slot is free again
        assert slot_c == 0
        c.communicate("\n")
        assert (tmp_path / runlock.LOCK_NAME).exists()  # b still runs
    finally:
        b.communicate("\n")
    assert b.returncode == 0
    assert not (tmp_path / runlock.LOCK_NAME).exists()  # the last member to leave released it
    runlock.acquire(tmp_path, command=["next"]).release()
