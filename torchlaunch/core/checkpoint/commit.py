"""The commit protocol on disk (rank 0, or the one process): how a checkpoint folder comes to exist.

  1. the format writes the state into a hidden temp folder, checksummed and fsynced (a sharded format:
     every rank its share, shares.py);
  2. rename the temp folder to step-NNNNNNNNN (atomic) and fsync the parent folder;
  3. write COMMITTED.json (the format's checksum and size, step, metrics) to a temp name, fsync,
     rename; fsync folder.
A crash at any byte leaves at most an invalid folder that discovery skips and the next start removes;
the previous checkpoint is never touched before a newer one is committed. Every step is relative to
RUN_DIR/checkpoints opened without following a link, so a link planted meanwhile is not written through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch import contract, rundir
from torchlaunch.base import storage
from torchlaunch.base.untrusted import quote
from torchlaunch.core.checkpoint.discovery import (
    FORMAT_VERSION,
    MARKER_FILE,
    REPLACED_PREFIX,
    STORAGE_MARK,
    TMP_PREFIX,
    CheckpointError,
    CheckpointStorageError,
    _remember_verified,
    check_root,
    ensure_run,
    newest_committed,
    read_marker,
    step_dir_name,
    verify,
)
from torchlaunch.core.checkpoint.formats import (
    DEFAULT_FORMAT,
    CheckpointFormat,
    expected_checksum,
    get_format,
)
from torchlaunch.exit_codes import BadInput


def _write_json_atomic(path: Path, payload: dict[str, Any], dir_fd: int | None = None) -> None:
    """The run dir's atomic writer, under a temp name clean_stale() knows to sweep; the folder is a step
    folder, never a link (real_folder), `path` relative to `dir_fd` when given."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    rundir.write_json(path, payload, indent=1, sort_keys=True, tmp=tmp, mkdir=False, real_folder=True, dir_fd=dir_fd)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _remove(name: str, dir_fd: int) -> None:
    """Remove `name` in the folder of `dir_fd`: a link or file unlinked (never followed), a folder's tree."""
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)


class _Replaced(OSError):
    """RUN_DIR/checkpoints no longer names the folder the save started in (a link put in its place)."""


def _still_root(root: Path, held: int) -> None:
    """Right before each commit step: `root` still names the real folder the save holds (rundir.same_folder);
    else _Replaced, and the save is abandoned without writing through the link."""
    if not rundir.same_folder(root, held):
        now = f"a symlink to {quote(os.readlink(root))}" if root.is_symlink() else "another folder or nothing"
        raise _Replaced(errno.ELOOP, f"{quote(str(root))} was replaced while the run trained (now {now})")


@dataclass(frozen=True)
class CommitInfo:
    path: Path
    step: int
    checksum: str
    size: int
    seconds: float


CommitGuard = Callable[[], "contextlib.AbstractContextManager[None]"]
"""Entered around a commit's renames and marker; may refuse with BadInput (write_checkpoint)."""
WriteShares = Callable[[Path, str], dict[str, Any]]
"""write_shares(pinned temp folder, its name under the root): the marker fields (write_checkpoint)."""


def write_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    before_commit: Callable[[Path], None] | None = None,
    replace: bool = False,
    format_name: str | None = None,
    commit_guard: CommitGuard | None = None,
    write_shares: WriteShares | None = None,
) -> CommitInfo:
    """Commit `state` as step `step` under `root`; raise CheckpointError and keep the previous on failure.

    A committed checkpoint of the same step is kept as it is unless `replace` (a newer state of the same
    step, e.g. after validation): then the new one is committed in full before the old one moves aside.
    `before_commit` is a test hook called with the temp folder after the state is written. The folder's
    files are the checkpoint format's (formats.py; `format_name`, default the single state.pt).
    `commit_guard()` is entered around the renames and the marker (live mode: the group's fence, held
    so that a superseded group never commits); a BadInput it raises leaves nothing but the previous
    checkpoints. `write_shares(folder, temp_name)`: writes the state in the temp folder instead of the
    format's `write` (a sharded format's collective write, shares.py), returning the marker fields.
    """
    fmt = get_format(format_name)
    start = time.perf_counter()
    check_root(root)
    root.mkdir(parents=True, exist_ok=True)
    run_id = ensure_run(root)
    final = root / step_dir_name(step)
    if not replace and verify(final) is None:
        marker = read_marker(final)
        return CommitInfo(final, step, expected_checksum(marker), marker["bytes"], 0.0)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        held = rundir.open_folder(root)  # every step below is relative to it: a link planted later is not followed
    except OSError as e:
        raise _save_failed(e, root, final, step) from None
    try:
        marker = _commit(
            root, held, tmp, final, step, state, meta, run_id, before_commit, fmt, commit_guard, write_shares
        )
    except BadInput:  # the commit guard refused (a superseded live group): nothing was committed
        _remove(tmp.name, held)
        raise
    except (OSError, RuntimeError) as e:  # torch.save wraps a failed write in a RuntimeError
        _remove(tmp.name, held)  # whatever failed, the temp folder holds nothing committed
        os_error = _root_os_error(e)
        if os_error is None:
            raise
        if _exists(final.name, held) and not _exists(f"{final.name}/{MARKER_FILE}", held):
            _remove(final.name, held)
        raise _save_failed(os_error, root, final, step) from None
    finally:
        os.close(held)
    _remember_verified(final, fmt.files(final, marker))
    return CommitInfo(final, step, marker["checksum"], marker["bytes"], time.perf_counter() - start)


def _commit(
    root: Path,
    held: int,
    tmp: Path,
    final: Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    run_id: str | None,
    before_commit: Callable[[Path], None] | None,
    fmt: CheckpointFormat,
    commit_guard: CommitGuard | None = None,
    write_shares: WriteShares | None = None,
) -> dict[str, Any]:
    """write_checkpoint's steps, each relative to `held` (RUN_DIR/checkpoints opened O_NOFOLLOW at the
    save's start) and each folder opened O_NOFOLLOW, with `root` re-checked right before every rename and
    the marker; returns the marker written. The format writes into the temp folder through a path pinned
    to that folder's descriptor (_format_folder), so whatever the format, its files land in the folder the
    save created, never in a link planted under RUN_DIR/checkpoints meanwhile."""
    os.mkdir(tmp.name, dir_fd=held)
    folder = rundir.open_folder(tmp.name, dir_fd=held)
    try:
        pinned = _format_folder(root, held, tmp, folder)
        fields = fmt.write(pinned, state) if write_shares is None else write_shares(pinned, tmp.name)
    finally:
        os.close(folder)
    if before_commit is not None:
        before_commit(tmp)
    _fault_injection_stall(tmp, step)
    marker = {**meta, **fields, "step": step, "format_version": FORMAT_VERSION, "committed_at": time.time()}
    if fmt.name != DEFAULT_FORMAT:  # a marker without "format" is the single file's (every older one)
        marker["format"] = fmt.name
    if run_id is not None:
        marker["run_id"] = run_id
    with commit_guard() if commit_guard is not None else contextlib.nullcontext():
        _still_root(root, held)
        if _exists(f"{final.name}/{MARKER_FILE}", held):
            # Commit inside the temp folder first, then swap: a crash between the two renames leaves
            # the old folder aside, and clean_stale() puts it back at the next start (no step is lost).
            _write_json_atomic(Path(tmp.name) / MARKER_FILE, marker, dir_fd=held)
            aside = f"{REPLACED_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            _still_root(root, held)
            os.rename(final.name, aside, src_dir_fd=held, dst_dir_fd=held)
            os.rename(tmp.name, final.name, src_dir_fd=held, dst_dir_fd=held)
            os.fsync(held)
            _remove(aside, held)
        else:
            if _exists(final.name, held):  # an uncommitted leftover of a crashed save of this same step
                _remove(final.name, held)
            os.rename(tmp.name, final.name, src_dir_fd=held, dst_dir_fd=held)
            os.fsync(held)
            _still_root(root, held)
            _write_json_atomic(Path(final.name) / MARKER_FILE, marker, dir_fd=held)
    return marker


def _format_folder(root: Path, held: int, tmp: Path, folder: int) -> Path:
    """The path a checkpoint format is handed for the temp folder: one that names the descriptor
    `folder` itself (rundir.folder_path), so a format that opens files by path (every format does) writes
    in the folder the save created, whatever RUN_DIR/checkpoints names by then. Where the system has no
    such path, `tmp` through `root`, checked right here to still be that folder (a link planted later
    than this check is caught by the renames' checks, but the format's bytes may have gone through it)."""
    pinned = rundir.folder_path(folder)
    if pinned is not None:
        return pinned
    _still_root(root, held)
    if not rundir.same_folder(tmp, folder):
        raise _Replaced(errno.ELOOP, f"{quote(str(tmp))} was replaced while the run trained")
    return tmp


def _save_failed(os_error: OSError, root: Path, final: Path, step: int) -> CheckpointError:
    """The one line a failed save raises, saying what survived (the previous checkpoint is never touched)."""
    previous = newest_committed(root) if not root.is_symlink() else None
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    if isinstance(os_error, (_Replaced, rundir.LinkedFolder)):
        return CheckpointStorageError(
            f"{STORAGE_MARK}{os_error.strerror}: the save of step {step} is abandoned and nothing was written "
            f"through the link; the checkpoints committed before it were not touched; exit 2: remove the link "
            "and put RUN_DIR/checkpoints back, then run the same command again"
        )
    if os_error.errno in storage.FULL:
        left = storage.free_space(root)
        return CheckpointStorageError(
            f"{STORAGE_MARK}no space left on device writing {final} ({left or 'unknown'} free; free space "
            f"or point run_dir at a larger volume, then run the same command again); {kept}; exit 2: a retry "
            "before that fails at this same save"
        )
    if storage.is_storage(os_error):
        return CheckpointStorageError(
            f"{STORAGE_MARK}{storage.describe(os_error, final, 'writing')}; {kept}; exit 2: not retried"
        )
    return CheckpointError(f"checkpoint error: writing {final} failed: {os_error} ({kept})")


def _root_os_error(e: BaseException) -> OSError | None:
    """The OSError behind an exception chain (torch's zip writer reports ENOSPC as a RuntimeError)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _fault_injection_stall(tmp: Path, step: int) -> None:
    """Fault-injection aid for crash tests: with TORCHLAUNCH_FAULT_SAVE_STALL_S set, saves of steps from
    TORCHLAUNCH_FAULT_SAVE_STALL_FROM_STEP (default 0) announce that a write is provably in progress (a
    STALLING file in the temp folder) and hold it open that long."""
    stall = contract.get(contract.FAULT_SAVE_STALL_S)
    if stall and step >= int(contract.get(contract.FAULT_SAVE_STALL_FROM_STEP, "0") or "0"):
        marker = tmp / "STALLING"
        marker.write_text(str(os.getpid()))
        time.sleep(float(stall))
        marker.unlink()
