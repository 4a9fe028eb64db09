"""OS errors on storage the user owns (a run dir, a cache, a checkpoint folder): one line, exit 2.

A run dir lives on shared storage that fills up, goes read-only, or is given a name the filesystem
cannot hold. None of that is a crash of ours, and a retry fails the same way until someone fixes the
storage, so it must not be exit 1 (schedulers retry exit 1, each retry redoing the steps since the
last checkpoint). Every place that meets such an error (the launchers, the job record, the run lock,
the worker's run-dir and cache writes, a checkpoint save) words it here: the path, what the errno
means, and what to do about it.

Stdlib only: the launchers import it before torch.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from torchlaunch.exit_codes import BadInput

FULL = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)
"""Out of space or quota: a save fails again at the same place until space is freed."""

FIXES: dict[int, str] = {
    errno.ENOSPC: "free space there or use a larger volume",
    errno.EROFS: "the filesystem is mounted read-only: remount it read-write or pick a writable folder",
    errno.ENAMETOOLONG: "a path component is over the filesystem's limit (usually 255 bytes): use a shorter name",
    errno.ENOTDIR: "a file stands where a folder must be: move that file away or pick another folder",
    errno.EEXIST: "a file stands where a folder must be: move that file away or pick another folder",
    errno.EISDIR: "a folder stands where a file must be: move it away",
    errno.EACCES: "you may not write there: fix its permissions or pick a folder you own",
    errno.EPERM: "you may not write there: fix its permissions or pick a folder you own",
    errno.ELOOP: "a symlink loop is in the path: fix or remove the link",
    errno.EIO: "the storage reports an I/O error: check the disk or mount, then run again",
}
if hasattr(errno, "EDQUOT"):
    FIXES[errno.EDQUOT] = "your disk quota is used up: free space or raise the quota"

STORAGE_ERRNOS = frozenset(FIXES)
"""errnos that are the storage's state, not this program's fault: refused as bad input."""


class StorageError(BadInput):
    """The user's storage refused a write or a read: one line and exit 2 (a retry would fail the same way)."""


def is_storage(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in STORAGE_ERRNOS


def refused_write(error: BaseException) -> bool:
    """An error escaping the project's own program that is the storage's refusal: full, over quota or
    read-only on any write (a log line's write names no file), any storage errno where a file is named
    (EPERM or EIO of a call on no file may be a process's or a device's)."""
    if not isinstance(error, OSError):
        return False
    return error.errno in FULL or error.errno == errno.EROFS or (is_storage(error) and error.filename is not None)


def free_space(path: str | os.PathLike[str]) -> str | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent), human-sized."""
    here = Path(path)
    for candidate in (here, *here.parents):
        try:
            free = shutil.disk_usage(candidate).free
        except OSError:
            continue
        for unit in ("bytes", "KB", "MB", "GB"):
            if free < 1024 or unit == "GB":
                return f"{free:.0f} {unit}" if unit == "bytes" else f"{free:.1f} {unit}"
            free /= 1024
    return None


def describe(error: OSError, path: str | os.PathLike[str] | None = None, what: str = "run dir") -> str:
    """`<what> PATH: <errno's meaning> (<fix>)`; for a full disk also the free space left."""
    where = path if path is not None else error.filename
    meaning = error.strerror or type(error).__name__
    fix = FIXES.get(error.errno or 0, "check the storage and run again")
    named = f" {os.fsdecode(where)}" if where is not None else ""
    if len(named) > 300:
        named = named[:140] + "..." + named[-140:]
    if error.errno in FULL and where is not None:
        left = free_space(where)
        if left is not None:
            meaning = f"{meaning}, {left} free"
    return f"{what}{named}: {meaning} ({fix})"


def refusal(
    error: OSError, path: str | os.PathLike[str] | None = None, *, prefix: str = "launch error: ", what: str = "run dir"
) -> StorageError:
    """The StorageError for `error` (raise it `from None`): one line, exit 2 where it is caught."""
    return StorageError(prefix + describe(error, path, what))
