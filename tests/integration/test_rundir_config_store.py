"""test_rundir_config_store: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_rundir_config.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchlaunch.agent import ranks
from torchlaunch.exit_codes import BAD_INPUT, BadInput
from torchlaunch.launch import elastic


def test_an_elastic_launch_refuses_a_rendezvous_store_of_another_run() -> None:
    """Before: a second job on the same --master-addr/--master-port trained on the first job's store
    and died with it (109 lines, exit 75). A store here plays the first job's agent's: it holds the
    first run's rendezvous key only."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    host.set(elastic.RENDEZVOUS_KEY + "tl-first", "Y2FuaW1hZGFt")
    elastic.check_store("127.0.0.1", host.port, "tl-first", wait_s=0.5)  # its own job's store: joined
    with pytest.raises(BadInput) as info:
        elastic.check_store("127.0.0.1", host.port, "tl-second", wait_s=0.5)
    assert str(info.value) == (
        f"launch error: --master-addr '127.0.0.1' --master-port {host.port}: the rendezvous store there belongs "
        "to another job (no rendezvous 'tl-second' in it after 0.5 s); pass a --master-port no other job uses"
    )


def test_the_agent_reports_another_runs_store_as_bad_input_before_joining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's wrapper runs the check (torch is imported there anyway) and leaves rank 0's outcome,
    so launch.local says it in one line and exits 2 instead of joining the store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from torchlaunch import status
    from torchlaunch.launch import torchrun

    host = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setattr(elastic.check_store, "__defaults__", (0.5,))
    argv = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{host.port}", "--rdzv-id", "tl-second", "-m", "x"]
    assert torchrun.foreign_store(["--nnodes", "2", *argv[2:]]) is None  # a fixed node count: no such store
    monkeypatch.setenv(status.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(status.ATTEMPT_ENV, "a1")
    monkeypatch.setattr("sys.argv", ["torchrun", *argv])
    assert torchrun.main() == BAD_INPUT
    (record,) = status.records(tmp_path, "a1")
    assert record.code == BAD_INPUT and "belongs to another job" in record.reason and "\n" not in record.reason


def test_no_store_listening_is_this_launchers_to_host() -> None:
    free = ranks.free_port()
    assert not elastic.listening("127.0.0.1", free)
    elastic.check_store("127.0.0.1", free, "tl-any", wait_s=0.5)
