"""test_rundir_faults: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_rundir_faults.py.
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
    from torchlaunch.backends.local import launch as local

    assert local.not_an_option("-run/config.yaml") == "./-run/config.yaml"
    assert local.not_an_option("/abs/-run/config.yaml") == "/abs/-run/config.yaml"


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
