"""test_rundir_faults: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_rundir_faults_os.py.
"""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest

from torchlaunch.base import files, storage
from torchlaunch.data import folders
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import cli, ranklog


def test_storage_words_every_errno_with_its_fix(tmp_path: Path) -> None:
    for code in storage.STORAGE_ERRNOS:
        line = storage.describe(OSError(code, os.strerror(code), str(tmp_path / "x")))
        assert line.startswith(f"run dir {tmp_path / 'x'}: {os.strerror(code)}") and line.endswith(")")
    assert not storage.is_storage(OSError(errno.ECONNRESET, "reset"))


def test_a_run_dir_starting_with_a_dash_is_not_read_as_an_option() -> None:
    from torchlaunch.agent import commands

    assert commands.not_an_option("-run/config.yaml") == "./-run/config.yaml"
    assert commands.not_an_option("/abs/-run/config.yaml") == "/abs/-run/config.yaml"


def test_a_log_symlinked_elsewhere_is_not_printed_and_the_tee_does_not_write_through_it(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root:$6$hash\n")
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "rank-0.log").symlink_to(secret)
    out = io.StringIO()
    assert cli.main(["logs", str(tmp_path / "run")], out=out) == 0
    assert "hash" not in out.getvalue()
    fd = ranklog.open_log(str(logs / "rank-0.log"))  # the tee's open: the link is replaced, not followed
    os.write(fd, b"line\n")
    os.close(fd)
    assert secret.read_text() == "root:$6$hash\n" and not (logs / "rank-0.log").is_symlink()
    os.unlink(logs / "rank-0.log")
    os.mkfifo(logs / "rank-0.log")
    fd = ranklog.open_log(str(logs / "rank-0.log"))  # a FIFO without a reader would block the open
    os.close(fd)
    assert (logs / "rank-0.log").is_file()


def test_a_2_gb_log_is_read_from_its_tail(tmp_path: Path) -> None:
    log = tmp_path / "run" / "logs" / "rank-0.log"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GB that take no disk
        f.seek(0, os.SEEK_END)
        f.write(b"\n2026-12-01T00:00:00.000Z last line\n")
    lines, offset = ranklog.read_lines(log, 0)
    assert [t for *_, t in lines][-1] == b"last line" and offset == log.stat().st_size
    data, start = files.read_range(log, -100, 100)
    assert len(data) == 100 and start == log.stat().st_size - 100


def test_an_image_folder_with_a_fifo_or_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    for odd in ("fifo", "loop"):
        root = tmp_path / odd
        (root / "cat").mkdir(parents=True)
        (root / "cat" / "a.jpg").write_bytes(b"x")
        if odd == "fifo":
            os.mkfifo(root / "cat" / "b.jpg")
        else:
            (root / "cat" / "b.jpg").symlink_to(root / "cat" / "c.jpg")
            (root / "cat" / "c.jpg").symlink_to(root / "cat" / "b.jpg")
        with pytest.raises(BadInput, match=r"b\.jpg is not an image file"):
            folders.scan_imagefolder(root)


def test_the_tee_outlives_a_full_disk_and_the_console_gets_every_line(tmp_path: Path, monkeypatch, capfd) -> None:
    """Issue #52 item 6: the rank log's writer died of ENOSPC with a traceback; its rank's next line met a
    closed pipe and the rank died too (exit 1), its one-line storage error never shown. The log (here
    /dev/full: every write is ENOSPC) loses lines, the tee and the console do not; said once."""
    log = str(tmp_path / "logs" / "rank-0.log")
    monkeypatch.setattr(ranklog, "open_log", lambda path: os.open("/dev/full", os.O_WRONLY))
    monkeypatch.setattr(ranklog.signal, "signal", lambda *args: None)  # the tee's own: not pytest's handlers
    out_r, out_w = os.pipe()
    console_r, console_w = os.pipe()
    os.write(out_w, b"epoch 1/3 step 8/8\ncheckpoint error: storage: no space left on device writing X\n")
    os.close(out_w)  # the rank has gone: the tee drains and ends
    assert ranklog.tee_main(log, [(out_r, console_w)]) == 0
    os.close(console_w)
    assert (
        os.read(console_r, 4096)
        == b"epoch 1/3 step 8/8\ncheckpoint error: storage: no space left on device writing X\n"
    )
    os.close(console_r)
    said = [line for line in capfd.readouterr().err.splitlines() if line]
    assert said == [f"launch: {log}: No space left on device: lines go to the console only"]


def test_a_log_that_could_not_be_written_says_where_lines_are_missing_once_it_can(tmp_path: Path, capfd) -> None:
    log = tmp_path / "rank-0.log"
    full = os.open("/dev/full", os.O_WRONLY)
    sink = ranklog.LogSink(full, str(log))
    stamper = ranklog.LineStamper(sink)
    stamper.feed(b"lost 1\nlost 2\n")
    stamper.feed(b"lost 3\n")
    os.close(full)
    sink.fd = ranklog.open_log(str(log))  # space freed
    stamper.feed(b"kept\n")
    os.close(sink.fd)
    lines = [line.split(b" ", 1)[1] for line in log.read_bytes().splitlines()]
    assert lines == [b"launch: lines missing above (No space left on device)", b"kept"]
    assert capfd.readouterr().err.count("No space left on device") == 1


def test_a_log_that_fails_to_open_for_another_reason_is_kept(tmp_path: Path, monkeypatch) -> None:
    """open_log replaces a link or a FIFO under the log's name; a log it merely cannot open now (out of
    descriptors, an I/O error) is the run's record: never removed."""
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"2026-12-01T00:00:00.000Z the run's first lines\n")
    real_open = os.open

    def no_descriptors(path, flags, *args, **kwargs):
        if str(path) == str(log):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_descriptors)
    fd = ranklog.open_log(str(log))
    monkeypatch.undo()
    os.close(fd)
    assert log.read_bytes() == b"2026-12-01T00:00:00.000Z the run's first lines\n"


def test_a_full_disk_mid_run_is_exit_2_and_its_line_though_no_record_can_be_written(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Issue #52 item 6: on a full run dir the rank's outcome record (RUN_DIR/status) cannot be written
    either, so launch.local, which says a bad-input line from the records, said nothing and exited 1. The
    rank says its line itself when its record is refused; the launcher takes a 2 with no record as 2; a
    full disk escaping the built-in worker anywhere (a log line, a trace) is a storage error too."""
    from torchlaunch import exit_codes, rundir, runner, status

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(runner, "execute", lambda program, cwd=None: (_ for _ in ()).throw(full))
    code, reason = runner.outcome(runner.parse(["-m", "torchlaunch.worker", "--config", "x"]))
    assert code == exit_codes.BAD_INPUT and reason.startswith("storage error: writing: No space left on device")
    assert "free space" in reason and "\n" not in reason
    code, _ = runner.outcome(runner.parse([str(tmp_path / "user.py")]))  # a user's program: its own business
    assert code == exit_codes.FAILURE
    capsys.readouterr()

    monkeypatch.setenv(status.ATTEMPT_ENV, "a1")
    monkeypatch.setenv(status.STATUS_DIR_ENV, str(tmp_path / "status"))
    assert status.report(0, 2, "checkpoint error: storage: no space left on device") is True
    monkeypatch.setattr(rundir, "write_json", lambda *args, **kwargs: (_ for _ in ()).throw(full))
    assert status.report(1, 2, "checkpoint error: storage: no space left on device") is False

    assert exit_codes.node_code(2, [], 2) == exit_codes.BAD_INPUT  # the live agent passed its ranks' 2 on
    assert exit_codes.node_code(1, [], 2) == exit_codes.FAILURE  # torchrun's 1 says nothing more
