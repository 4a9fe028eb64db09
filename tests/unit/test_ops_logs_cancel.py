"""test_ops_logs_cancel: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_ops_logs_follow_and_cancel.py.
"""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.test_ops_logs_follow_and_cancel import HOST, fake_tools, logs, slurm_record, write_log
from torchlaunch.jobs import cli, ranklog, record


def test_logs_merge_ranks_in_time_order_with_prefixes(tmp_path: Path) -> None:
    write_log(tmp_path, 0, [(100.0, "r0 first"), (102.0, "r0 third")])
    write_log(tmp_path, 1, [(101.0, "r1 second"), (102.0, "r1 same ms as r0")])
    with open(ranklog.log_path(tmp_path, 1), "ab") as f:
        f.write(b"no stamp \xff here\npartial line still being writ")
    code, lines = logs(str(tmp_path))
    assert code == 0
    assert lines == [
        "[rank 0] r0 first",
        "[rank 1] r1 second",
        "[rank 0] r0 third",
        "[rank 1] r1 same ms as r0",
        "[rank 1] no stamp \ufffd here",
    ]
    assert logs(str(tmp_path), "--rank", "1")[1][0] == "[rank 1] r1 second"
    assert all(line.startswith("[rank 0]") for line in logs(str(tmp_path), "--rank", "0")[1])


def test_logs_of_a_run_without_logs_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logs(str(tmp_path)) == (0, [])
    assert capsys.readouterr().err == f"launch: no rank logs in {tmp_path}/logs yet\n"


def test_an_empty_rank_log_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`logs --rank 1` of a built-in run printed nothing at all: rank 1 prints only warnings (issue 51)."""
    write_log(tmp_path, 0, [(1.0, "x")])
    ranklog.log_path(tmp_path, 1).write_bytes(b"")
    assert logs(str(tmp_path), "--rank", "1") == (0, [])
    said = capsys.readouterr().err
    assert "rank 1's log is empty" in said and "rank 0 only" in said and "--rank 0" in said
    assert logs(str(tmp_path), "--rank", "0")[1] == ["[rank 0] x"] and capsys.readouterr().err == ""


def test_logs_of_a_missing_rank_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path, 0, [(1.0, "x")])
    assert logs(str(tmp_path), "--rank", "3")[0] == 2
    assert capsys.readouterr().err.strip() == (f"launch error: no log for rank 3 in {tmp_path}/logs (ranks: 0)")


def test_a_forged_slurm_job_id_is_never_passed_to_scancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_tools(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    run = tmp_path / "run"
    slurm_record(run, "1; touch pwned")
    assert cli.main(["cancel", str(run)], out=io.StringIO()) == 1
    assert "scancel" not in (calls.read_text() if calls.exists() else "")


def test_cancel_signals_only_the_recorded_process(tmp_path: Path) -> None:
    from torchlaunch.rundir import write_json

    rec = record.JobRecord(launch_id="X1", host=HOST, launcher_pid=os.getppid(), launcher_start=1, started=time.time())
    write_json(record.record_path(tmp_path), rec.to_json())
    out = io.StringIO()
    previous = signal.getsignal(signal.SIGTERM)
    assert cli.main(["cancel", str(tmp_path)], out=out) == 0  # the launcher is gone: nothing to stop
    assert signal.getsignal(signal.SIGTERM) is previous and "already failed" in out.getvalue()
