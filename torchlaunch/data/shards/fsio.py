"""File checks and durable writes for shards and indexes, shared by the reader, indexer and writer.

Why a check before every open: a shard folder is data anyone may have put there. A FIFO would block
open() forever and a symlink may point anywhere, so both are refused from an lstat before the file is
opened, and files are opened O_NONBLOCK | O_NOFOLLOW so a swap between the check and the open cannot
block or follow either; the fstat after the open is what the reader trusts.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from torchlaunch.data.shards.errors import ShardError

OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def regular_size(path: Path, what: str, fix: str) -> int | None:
    """The size of `path` if it is a regular file, None if it does not exist; ShardError for a symlink,
    FIFO or anything else that is not a plain file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ShardError(f"{what} {path} cannot be read ({e.strerror})", fix) from None
    if not stat.S_ISREG(st.st_mode):
        raise ShardError(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file", fix)
    return st.st_size


def open_regular(path: Path, what: str, fix: str) -> tuple[int, int]:
    """(fd, size) of a regular file opened without following a symlink or blocking on a FIFO."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        raise ShardError(f"{what} {path} is missing", fix) from None
    except OSError as e:
        if os.path.islink(path):
            raise ShardError(f"{what} {path} is a symlink, not a regular file", fix) from None
        raise ShardError(f"{what} {path} cannot be opened ({e.strerror})", fix) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ShardError(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file", fix)
    return fd, st.st_size


def read_all(path: Path, what: str, fix: str) -> bytes:
    fd, size = open_regular(path, what, fix)
    try:
        chunks = []
        done = 0
        while done < size:
            chunk = os.pread(fd, min(size - done, 1 << 26), done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, parts: list[bytes]) -> None:
    """Replace `path` with the concatenated parts: temp name, fsync, rename, fsync of the folder, so a
    crash leaves either the old file or the whole new one (the JSON counterpart is torchlaunch.rundir.write_json;
    this one writes binary and is always durable, since an index is what marks a shard complete)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # a full or read-only disk: leave no partial file behind (the caller words the error)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)
