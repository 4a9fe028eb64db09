"""The run dir's layout and its one atomic writer (stdlib only: launchers import it before torch).

A run dir is shared between the launcher, every rank, every requeue and the operator commands, so
each of them must agree on where a thing lives; a name spelled once here is a name that cannot drift
between a writer and its reader. Other modules ask for a path (`checkpoints(run_dir)`) and never
join a literal onto a run dir themselves.

Every file another process may read while it is written goes through `write_bytes` / `write_json`:
a temp name in the same folder (so the rename stays on one filesystem), the bytes, fsync of the
file, rename over the target, fsync of the folder. A reader therefore sees the old file or the new
one, never half of either; a crash right after the call keeps the new one. `durable=False` skips the
two fsyncs for files rewritten every few seconds (heartbeats, per-rank status records), where losing
the newest version to a power cut is harmless and an fsync per step is not.

What the writer does not do is word errors: it raises the OSError, and the caller decides what it
means (torchlaunch.base.storage words a run-dir write as one line and exit 2; a heartbeat ignores it).

What it does not do either is follow a folder out of the run dir: a run dir (and a shard set's output
folder) is untrusted storage, and a subfolder linked elsewhere would have every write, append and delete
in it land in the link's target (a foreign shard overwritten, a file in /tmp deleted by the lock's slot
sweep). `check_real_folder` is the one check, refused as bad input before anything is written:
checkpoints/ (torchlaunch.core.checkpoint.store), every folder in FOLDERS (the run lock, the worker's
config write) and the shard writer's split folders.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import BadInput

PathLike = str | os.PathLike[str]

# ---- the layout: one name per thing ------------------------------------------------------------

CHECKPOINTS = "checkpoints"
"""RUN_DIR/checkpoints/step-NNNNNNNNN/: committed checkpoints (torchlaunch.core.checkpoint.store)."""
QUARANTINE = "quarantine"
"""RUN_DIR/checkpoints/quarantine/: checkpoints set aside by `doctor` after they failed to verify."""
RUN_ID = "run_id.json"
"""RUN_DIR/run_id.json: the run's identity, written once; every commit marker carries it."""
STATUS = "status"
"""RUN_DIR/status/: each rank's outcome for the launcher (torchlaunch.status)."""
LOGS = "logs"
"""RUN_DIR/logs/rank-N.log: each rank's console output."""
PROGRESS = "progress"
"""RUN_DIR/progress/rank-N.json: each rank's heartbeat (and stack dumps beside it)."""
JOB = "job"
"""RUN_DIR/job/node-N.json: each node launcher's job record (the operator commands read it)."""
METRICS = "metrics.jsonl"
"""RUN_DIR/metrics.jsonl: the built-in worker's metrics, one JSON object a line."""
TENSORBOARD = "tb"
"""RUN_DIR/tb/: TensorBoard event files when logging.tensorboard is on."""
MODEL = "model.pt"
"""RUN_DIR/model.pt: the final weights, published once the final checkpoint is committed."""
CONFIG = "config.yaml"
"""RUN_DIR/config.yaml: the resolved config every rank and every requeue reads (written once)."""
DOCTOR_CONFIG = "doctor-config.yaml"
"""RUN_DIR/doctor-config.yaml: what `--doctor` checks; the pre-flight never rewrites the run's config."""
PRECISION = "precision.json"
"""RUN_DIR/precision.json: the precision `auto` chose at the run's first start."""
LOCK = ".lock.json"
"""RUN_DIR/.lock.json: the record of who holds the run dir (torchlaunch.runlock)."""
LOCK_GUARD = ".lock.guard"
"""RUN_DIR/.lock.guard: serialises takeovers of a stale lock."""
SLURM = "slurm"
"""RUN_DIR/slurm/JOB_ID/: submitit's pickles and the Slurm tasks' logs."""
LOCK_NODES = ".lock.nodes"
"""RUN_DIR/.lock.nodes/node-K.json: an elastic job's member slots (torchlaunch.runlock)."""
HANGS = "hangs"
"""RUN_DIR/hangs/STAMP-HOST-PID/: the hang watchdog's stack dumps (torchlaunch.jobs.watchdog)."""
TRACE = "trace"
"""RUN_DIR/trace/rankN.jsonl: each rank's batch trace when debug.trace_batches is on."""
LIVE = "live"
"""RUN_DIR/live/: live recovery's group generation (its lock) and each rank's regroup events."""
RDZV = "rdzv"
"""RUN_DIR/rdzv/: a user script's elastic rendezvous, sealed state and store (torchlaunch.launch.rdzv_file)."""
FOLDERS = (CHECKPOINTS, STATUS, LOGS, PROGRESS, JOB, TENSORBOARD, SLURM, LOCK_NODES, HANGS, TRACE, LIVE, RDZV)
"""Every folder the launchers and ranks write, append or delete in: each must be a real folder."""


def _under(run_dir: PathLike, name: str) -> Path:
    return Path(run_dir) / name


def checkpoints(run_dir: PathLike) -> Path:
    return _under(run_dir, CHECKPOINTS)


def quarantine(run_dir: PathLike) -> Path:
    return checkpoints(run_dir) / QUARANTINE


def run_id(run_dir: PathLike) -> Path:
    return _under(run_dir, RUN_ID)


def status(run_dir: PathLike) -> Path:
    return _under(run_dir, STATUS)


def logs(run_dir: PathLike) -> Path:
    return _under(run_dir, LOGS)


def progress(run_dir: PathLike) -> Path:
    return _under(run_dir, PROGRESS)


def job(run_dir: PathLike) -> Path:
    return _under(run_dir, JOB)


def metrics(run_dir: PathLike) -> Path:
    return _under(run_dir, METRICS)


def tensorboard(run_dir: PathLike) -> Path:
    return _under(run_dir, TENSORBOARD)


def model(run_dir: PathLike) -> Path:
    return _under(run_dir, MODEL)


def trace(run_dir: PathLike) -> Path:
    return _under(run_dir, TRACE)


def live(run_dir: PathLike) -> Path:
    return _under(run_dir, LIVE)


def rdzv(run_dir: PathLike) -> Path:
    return _under(run_dir, RDZV)


def config(run_dir: PathLike) -> Path:
    return _under(run_dir, CONFIG)


def doctor_config(run_dir: PathLike) -> Path:
    return _under(run_dir, DOCTOR_CONFIG)


def precision(run_dir: PathLike) -> Path:
    return _under(run_dir, PRECISION)


def lock(run_dir: PathLike) -> Path:
    return _under(run_dir, LOCK)


def lock_guard(run_dir: PathLike) -> Path:
    return _under(run_dir, LOCK_GUARD)


def slurm(run_dir: PathLike) -> Path:
    return _under(run_dir, SLURM)


# ---- no write follows a folder out ------------------------------------------------------------


def check_real_folder(folder: PathLike, *, prefix: str, what: str, fix: str) -> None:
    """BadInput (one line, exit 2) unless `folder` is absent or a real folder of its parent: a symlink
    (followed, every write, append and delete in it would land in its target), a file there, or a
    folder that resolves outside its parent (a bind mount, a linked ancestor swapped in). `what` names
    the folder's role, `fix` the way out; the check never follows or writes anything."""
    folder = Path(folder)
    if folder.is_symlink():
        target = os.readlink(folder)
        dangling = "" if folder.exists() else ", which does not exist"
        raise BadInput(
            f"{prefix}{quote(str(folder))} is a symlink to {quote(target)}{dangling} ({what} must be a real "
            f"folder: {fix})"
        )
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"{prefix}{quote(str(folder))} is not a folder ({what} must be one: move the file away)")
    if folder.exists() and folder.resolve().parent != folder.parent.resolve():
        raise BadInput(f"{prefix}{quote(str(folder))} resolves outside its folder ({what} must be a real folder)")


def check_folders(run_dir: PathLike, *, prefix: str = "launch error: ") -> None:
    """Every folder of FOLDERS in `run_dir` is real or absent (check_real_folder), before anything is
    written there; the run dir itself may be a link (the user named it)."""
    for name in FOLDERS:
        check_real_folder(
            _under(run_dir, name),
            prefix=prefix,
            what=f"RUN_DIR/{name}",
            fix="remove the link (nothing is written through one), or pick another run_dir",
        )


class LinkedFolder(OSError):
    """A run-dir folder that is a symlink (or no folder) when a write comes, after the start's checks
    passed: one planted while the run trains. An OSError (errno ELOOP), so every caller's handling of a
    failed write applies; nothing was written through it."""


def open_folder(folder: PathLike, *, dir_fd: int | None = None) -> int:
    """A descriptor of `folder`, opened without following a link in its last component (O_NOFOLLOW):
    what is written relative to it lands in that real folder, even if its path is swapped for a link
    later. LinkedFolder (one line) when it is a link now. The caller closes it."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(folder, dir_fd):
            raise LinkedFolder(
                errno.ELOOP,
                f"{quote(str(folder))} is a symlink now (swapped in while the run ran): not written through",
            ) from None
        raise


def _is_link(path: PathLike, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def same_folder(folder: PathLike, fd: int) -> bool:
    """`folder` still names the real folder behind `fd` (opened by open_folder): not a link, same inode.
    The check right before a commit: a folder renamed away and a link put in its place fail it."""
    try:
        now = os.lstat(folder)
    except OSError:
        return False
    held = os.fstat(fd)
    return stat.S_ISDIR(now.st_mode) and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def folder_path(fd: int) -> Path | None:
    """A path that names the folder behind `fd` itself, not whatever its old path names now: Linux's
    /proc/self/fd/N (the kernel resolves it to the open folder, so a rename of the folder or a link put
    in its place changes nothing). For code that can only be handed a path (a checkpoint format); None
    where the system has no such path."""
    pinned = Path(f"/proc/self/fd/{fd}")
    try:
        here, held = os.stat(pinned), os.fstat(fd)
    except OSError:
        return None
    return pinned if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino) else None


# ---- the one atomic writer ----------------------------------------------------------------------


def fsync_dir(folder: PathLike) -> None:
    """Make a rename (or a new entry) in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A hidden, unique sibling of `path` (same folder, so the final rename never crosses filesystems)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def publish(tmp: PathLike, path: PathLike, *, durable: bool = True) -> None:
    """Rename the finished `tmp` over `path` (and fsync the folder): the moment the new file appears."""
    os.replace(tmp, path)
    if durable:
        fsync_dir(Path(path).parent)


@contextmanager
def staged(path: PathLike, *, durable: bool = True, tmp: PathLike | None = None) -> Iterator[IO[bytes]]:
    """A binary file to write `path`'s new bytes into (a stream, e.g. torch.save's), under a temp name;
    on a clean exit it is fsynced (`durable`) and left for `publish`, on an error it is removed."""
    tmp_path = Path(tmp) if tmp is not None else temp_name(Path(path))
    try:
        with open(tmp_path, "wb") as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_bytes(
    path: PathLike,
    data: bytes,
    *,
    durable: bool = True,
    tmp: PathLike | None = None,
    mkdir: bool = True,
    real_folder: bool = False,
    dir_fd: int | None = None,
    mode: int = 0o666,
) -> None:
    """Replace `path` with `data` atomically: temp file in the same folder, fsync, rename, fsync folder
        (`durable=False`: temp file and rename only). `tmp` names the temp file where a sweep must know it.
        The temp file is created and renamed relative to the folder's descriptor, so both land in one folder.
        `real_folder`: the folder is one of the run dir's (FOLDERS, a step folder), never a link: opened
        O_NOFOLLOW (open_folder), a link planted there while the run trains is LinkedFolder, not followed.
        Without it the folder may be a link the user named (the run dir itself). `dir_fd`: `path` is relative
        to that folder's descriptor (a checkpoint commit's, held from the save's start). `mode`: the new file's
    (before the umask): 0o600 for a record only this user may read."""
    path = Path(path)
    if mkdir and dir_fd is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp_name = Path(tmp).name if tmp is not None else temp_name(path).name
    if real_folder:
        folder = open_folder(path.parent, dir_fd=dir_fd)
    else:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        fd = os.open(
            tmp_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder
        )
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                if durable:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp_name, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.unlink(tmp_name, dir_fd=folder)
            except OSError:
                pass
            raise
        if durable:
            os.fsync(folder)
    finally:
        os.close(folder)


def create_once(name: str, data: bytes, *, dir_fd: int, mode: int = 0o600) -> bool:
    """Make `name` in the folder of `dir_fd` with `data` and `mode` unless it exists: written whole and
    fsynced under a temporary name, then linked to `name`, which never replaces a file already there
    (another process's, made first, is kept: False). For a record every process must read the same of
    (the live group's secret), where write_bytes' replace would let a later writer change it."""
    tmp = f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            return False
    finally:
        os.unlink(tmp, dir_fd=dir_fd)
    os.fsync(dir_fd)
    return True


def write_text(path: PathLike, text: str, **kwargs: Any) -> None:
    """write_bytes of `text` as UTF-8."""
    write_bytes(path, text.encode("utf-8"), **kwargs)


def write_json(
    path: PathLike,
    value: Any,
    *,
    durable: bool = True,
    indent: int | None = None,
    sort_keys: bool = True,
    newline: bool = False,
    tmp: PathLike | None = None,
    mkdir: bool = True,
    real_folder: bool = False,
    dir_fd: int | None = None,
) -> None:
    """write_bytes of `value` as JSON (the format options are the readers' business, not the writer's)."""
    text = json.dumps(value, indent=indent, sort_keys=sort_keys) + ("\n" if newline else "")
    data = text.encode("utf-8")
    write_bytes(path, data, durable=durable, tmp=tmp, mkdir=mkdir, real_folder=real_folder, dir_fd=dir_fd)
