"""Run-dir files that other processes read while they are written: the guarded read.

Writers go through torchlaunch.rundir's atomic writer, so a reader never meets half a file it wrote;
a reader still treats a missing, oversized, truncated, non-UTF-8 or non-object file as absent and says
why, because a run dir is shared storage that anything may have written: its contents are data,
never trusted to be well-formed.

Nor is what a name points at trusted: every read of a run-dir file goes through open_regular, which
refuses a FIFO or a device (opened non-blocking, then fstat: a FIFO would block the reader forever), a
symlink as the last component (O_NOFOLLOW: a log linked to /etc/shadow is not printed by a root
`launch logs`), and reads at most a bounded number of bytes (a 2 GB log is read from its tail).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from torchlaunch.base.untrusted import load_json

MAX_BYTES = 256 * 1024
"""Larger files are refused unread: a record is a few hundred bytes."""


class NotRegular(OSError):
    """The name is a FIFO, socket, device, folder or (not followed) symlink, not a regular file."""


def open_regular(path: str | os.PathLike[str], *, follow: bool = False) -> int:
    """A read-only fd on the regular file `path`, opened without blocking and, unless `follow`,
    without following a symlink as its last component; NotRegular (an OSError) for anything else."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow and os.path.islink(path):
            raise NotRegular(errno.ELOOP, "a symlink, not followed", os.fspath(path)) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise NotRegular(errno.EINVAL, kind, os.fspath(path))
    return fd


def read_range(path: str | os.PathLike[str], offset: int, limit: int, *, follow: bool = False) -> tuple[bytes, int]:
    """At most `limit` bytes of the regular file `path` from `offset` (negative: that many bytes
    before its end), and the offset they start at; OSError (NotRegular) as open_regular."""
    fd = open_regular(path, follow=follow)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size + offset) if offset < 0 else offset
        chunks: list[bytes] = []
        left, at = limit, start
        while left > 0:
            chunk = os.pread(fd, min(left, 1 << 20), at)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
            at += len(chunk)
        return b"".join(chunks), start
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike[str], limit: int = MAX_BYTES, *, follow: bool = False) -> bytes:
    """The whole regular file when it has at most `limit` bytes; OSError (EFBIG) when larger."""
    data, _ = read_range(path, 0, limit + 1, follow=follow)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
    return data


def why_unreadable(e: OSError) -> str:
    """The short reason for a problem line: `unreadable (a FIFO)`, `unreadable (Permission denied)`."""
    return f"unreadable ({e.strerror or type(e).__name__})"


def read_json(path: Path, limit: int = MAX_BYTES) -> tuple[dict[str, Any] | None, str | None]:
    """(object, None), or (None, why it cannot be used); never raises (nor blocks, on a FIFO). Files over
    `limit` bytes are refused unread (a shard set's manifest lists every shard: it passes a larger one)."""
    try:
        raw, _ = read_range(path, 0, limit + 1)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, why_unreadable(e)
    if len(raw) > limit:
        return None, f"larger than {limit} bytes"
    try:
        value = load_json(raw)  # depth-checked before the recursive parser runs
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not valid JSON (truncated?)"
    except RecursionError:
        return None, "nested too deeply"
    if not isinstance(value, dict):
        return None, "not a JSON object"
    return value, None


def as_int(value: Any, low: int | None = None, high: int | None = None) -> int | None:
    """An int field from untrusted JSON (bools and out-of-range values are None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if (low is not None and value < low) or (high is not None and value > high):
        return None
    return value


def as_float(value: Any, low: float | None = None) -> float | None:
    """A finite number from untrusted JSON, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        return None
    if low is not None and number < low:
        return None
    return number


def as_str(value: Any, limit: int = 4096) -> str | None:
    """A string field from untrusted JSON, cut to `limit` characters."""
    return value[:limit] if isinstance(value, str) else None


def printable(text: str) -> str:
    """`text` safe for a terminal: control characters (escape sequences, newlines) shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
