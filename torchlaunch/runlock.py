"""One live job owns a run dir: RUN_DIR/.lock.json names it, and a second launch is refused.

Without it two launches on one run dir both run, the second rewrites RUN_DIR/config.yaml, and the
first trains the second one's config. The lock is taken before anything is written to the run dir.

How ownership is decided:

- Creation is atomic: the lock file is made with O_CREAT | O_EXCL (atomic on local filesystems and
  NFSv3+), so of two launches racing for a free run dir exactly one creates it.
- The record names the holder: host, pid, the pid's start time from /proc/PID/stat and the boot id
  (a reused pid has another start time), or a scheduler and job id once the job is handed to a
  scheduler (the launcher exits, the job keeps the lock), plus when and what was started.
- A stale lock (same host and the pid gone or started at another time; a scheduler job the caller's
  `job_alive` callable says is over) is taken over with one warning line. A holder on another host
  without a job id cannot be checked from here, so it counts as live; the refusal says how to clear it.
- A lock held by the caller's own scheduler job (a Slurm requeue, a replacement pod of the same Job)
  is the same owner coming back: taken over silently.
- Taking over a stale lock is done under an flock on RUN_DIR/.lock.guard, so two launches that both
  judge the same lock stale cannot both replace it; flock is released by the kernel when its process
  dies, so the guard itself never goes stale. Where the filesystem has no flock, a stale lock is
  refused instead (with the command that clears it), never raced for.
- The holder also keeps an flock on the lock file for its life where the filesystem supports it: a
  lock file some process still holds that way is live whatever its record says.
- Released (the file removed, only if it is still ours) on exit, normal or by exception.
- An elastic job (launch.elastic: every node's launcher on one shared run dir, nodes leaving and
  joining) is one owner: the record names its `job`, a launcher of the same job joins instead of being
  refused, and each member holds a node slot, RUN_DIR/.lock.nodes/node-K.json (created O_EXCL, flocked
  for the member's life; K also names the member's job record). The job is live while any member's slot
  is, whoever wrote the record (the node that wrote it may be the one that was lost); the last member
  to leave removes the lock.

Stdlib only.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import json
import os
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

try:
    import fcntl
except ImportError:  # not POSIX: O_EXCL and the record alone
    fcntl = None  # type: ignore[assignment]

from torchlaunch import rundir
from torchlaunch.base import files, procs, storage
from torchlaunch.base.untrusted import load_json
from torchlaunch.exit_codes import BadInput

LOCK_NAME = rundir.LOCK
GUARD_NAME = rundir.LOCK_GUARD
NODES_DIR = rundir.LOCK_NODES
MAX_SLOTS = 100_000
FORMAT = 1
UNREADABLE = "unreadable"
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)

JobAlive = Callable[[str, str], bool]
"""(scheduler, job_id) -> True while that job is pending or running (e.g. squeue/sacct for Slurm)."""


def pid_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None off Linux or if gone."""
    return procs.start_ticks(pid)


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as stream:
            return stream.read().strip()
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


@dataclass(frozen=True)
class Holder:
    """Who owns a run dir, as written in its lock file."""

    host: str
    pid: int
    pid_start: int | None = None
    boot: str | None = None
    scheduler: str | None = None
    job_id: str | None = None
    started: float = 0.0
    command: list[str] = field(default_factory=list)
    token: str = ""
    format: int = FORMAT
    job: str | None = None
    """An elastic job's key (launch.elastic.job_key): launchers with the same one share the run dir."""
    incarnation: str = ""
    """An elastic member's run of the job: the token of the member that found no other one alive (it
    founded this run), copied by every member that joined while one was alive. A rerun of the same
    command after every member left is another incarnation (live/fence.py's founded record)."""

    @classmethod
    def me(
        cls,
        command: list[str] | None = None,
        scheduler: str | None = None,
        job_id: str | None = None,
        job: str | None = None,
    ) -> Holder:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            pid_start=pid_start_time(pid),
            boot=boot_id(),
            scheduler=scheduler,
            job_id=job_id,
            started=time.time(),
            command=list(sys.argv if command is None else command),
            token=uuid.uuid4().hex,
            job=job,
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Holder:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)

    def describe(self) -> str:
        if self.token == UNREADABLE:
            return "a holder whose record cannot be read (being written this instant, or damaged)"
        who = f"{self.scheduler} job {self.job_id}" if self.scheduler and self.job_id else f"pid {self.pid}"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "unknown time"
        command = shlex.join(self.command)
        if len(command) > 80:
            command = command[:77] + "..."
        return f"{who} on {self.host}, started {when} ({command!r})"


def read_holder(path: Path) -> Holder | None:
    """The record in a lock file; None when the file is gone or not a record of ours (unreadable)."""
    try:
        data = load_json(files.read_bytes(path, files.MAX_BYTES))  # a FIFO is refused, not waited on
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        return Holder(host="?", pid=-1, token=UNREADABLE)
    if not isinstance(data, dict) or "host" not in data or "pid" not in data:
        return Holder(host="?", pid=-1, token=UNREADABLE)
    try:
        return Holder.from_json(data)
    except TypeError:
        return Holder(host="?", pid=-1, token=UNREADABLE)


def flock_held(path: Path) -> bool | None:
    """True when some process holds an flock on `path`; False when none does; None when unknown."""
    if fcntl is None:
        return None
    try:
        fd = files.open_regular(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # releases our probe lock with it
    return False


class RunLock:
    """`with RunLock(run_dir).acquire():` owns `run_dir` until the block (or the process) ends.

    `scheduler`/`job_id` name the caller's own scheduler job, if any (a lock held by that same job
    is taken over silently); `job_alive` answers whether another holder's scheduler job is still on
    (torchlaunch.backends.alive asks the holder's backend; without one the holder is live)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        command: list[str] | None = None,
        scheduler: str | None = None,
        job_id: str | None = None,
        job_alive: JobAlive | None = None,
        warn: TextIO | None = None,
        job: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.holder = Holder.me(command, scheduler, job_id, job)
        self.job_alive = job_alive
        self.warn = warn
        self._fd: int | None = None
        self._released = True
        self.slot: int | None = None
        """An elastic member's node slot (RUN_DIR/.lock.nodes/node-K.json); None for other launches."""
        self._slot_fd: int | None = None
        self.founded = False
        """An elastic member that found no live member of its job when it joined: it starts the job
        (again); a later member joins a job already running (a live job's replacement node)."""

    # ---- public ------------------------------------------------------------------------------

    def acquire(self) -> RunLock:
        """Own the run dir; BadInput naming a live holder, a folder of it linked elsewhere (nothing is
        written through one: rundir.check_folders), or the storage's refusal (torchlaunch.base.storage)."""
        rundir.check_folders(self.run_dir)
        try:
            return self._join() if self.holder.job else self._acquire()
        except OSError as error:
            if not storage.is_storage(error):
                raise
            raise storage.refusal(error, error.filename or self.run_dir) from None

    def _acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._create():
            return self._owned()
        with self._guard() as guarded:
            current = read_holder(self.path)
            if current is None and self._create():
                return self._owned()
            current = current or read_holder(self.path)
            if current is None:
                raise BadInput(f"launch error: run dir {self.run_dir}: its lock came and went; run the command again")
            verdict = self.judge(current)
            self._take_over(current, verdict, guarded)
            return self._owned()

    def _take_over(self, current: Holder, verdict: str, guarded: bool) -> None:
        """Replace a lock judged `verdict` (under the guard), or refuse a live or unguardable one."""
        if verdict == "live":
            raise BadInput(
                f"launch error: run dir {self.run_dir} is in use by {current.describe()}; wait for it, stop it, "
                f"or pass another run dir (if that job is gone, remove {self.path})"
            )
        if not guarded:
            raise BadInput(
                f"launch error: run dir {self.run_dir} has a stale lock of {current.describe()}, and this "
                f"filesystem has no flock to take it over safely; remove {self.path} and run again"
            )
        if verdict == "stale":
            self._say(f"launch: taking over run dir {self.run_dir} from {current.describe()}: that holder is gone")
        self.path.unlink(missing_ok=True)
        if not self._create():
            raise BadInput(f"launch error: run dir {self.run_dir}: another launch took it first; see {self.path}")

    def _join(self) -> RunLock:
        """An elastic job's launcher: own the run dir for the job, or join the job that owns it, and hold
        a node slot. All under the guard, so members coming and going never race one another."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._guard() as guarded:
            current = read_holder(self.path)
            if current is None:
                if not self._create():
                    raise BadInput(
                        f"launch error: run dir {self.run_dir}: its lock came and went; run the command again"
                    )
            elif current.job != self.holder.job:
                self._take_over(current, self.judge(current), guarded)
            elif self.judge(current, members=False) == "stale" and guarded:
                self.path.unlink(missing_ok=True)  # the job's own record, its writer gone: name a live member
                self._create()
            members = self.live_members(self.holder.job or "")
            self.founded = not members
            founder = self.holder.token if self.founded else (members[0].incarnation or members[0].token)
            self.holder = dataclasses.replace(self.holder, incarnation=founder)
            self.slot = self._claim_slot()  # the slot's record carries the incarnation to later members
        return self._owned()

    def _claim_slot(self) -> int:
        """The lowest node slot no live member holds (caller holds the guard)."""
        folder = self.run_dir / NODES_DIR
        folder.mkdir(exist_ok=True)
        for k in range(MAX_SLOTS):
            path = folder / f"node-{k}.json"
            if path.exists() and slot_live(path, self.holder):
                continue
            path.unlink(missing_ok=True)
            fd = _create_record(path, self.holder)
            if fd is not None:
                self._slot_fd = fd
                return k
        raise BadInput(f"launch error: run dir {self.run_dir}: {MAX_SLOTS} node slots in use; see {folder}")

    def live_members(self, job: str) -> list[Holder]:
        """The live members of elastic job `job` on this run dir, this launcher excepted."""
        found = []
        for path in sorted((self.run_dir / NODES_DIR).glob("node-*.json")):
            member = read_holder(path)
            if member is None or member.job != job or member.token == self.holder.token:
                continue
            if slot_live(path, self.holder):
                found.append(member)
        return found

    def release(self) -> None:
        """Remove the lock file if it is still ours (a later owner's lock is never removed)."""
        if self._released:
            return
        self._released = True
        if self.slot is not None:
            self._leave()
            return
        try:
            current = read_holder(self.path)
            if current is not None and current.token == self.holder.token:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # the run dir went read-only or away: the flock dies with us, so the lock reads as stale
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _leave(self) -> None:
        """An elastic member leaves: its slot goes; the last member of the job removes the lock."""
        job = self.holder.job or ""
        try:
            with self._guard():
                if self.slot is not None:
                    (self.run_dir / NODES_DIR / f"node-{self.slot}.json").unlink(missing_ok=True)
                current = read_holder(self.path)
                if current is not None and current.job == job and not self.live_members(job):
                    self.path.unlink(missing_ok=True)
        except OSError:
            pass  # the run dir went read-only or away: the flocks die with us, so the lock reads as stale
        finally:
            for fd in (self._slot_fd, self._fd):
                if fd is not None:
                    os.close(fd)
            self._slot_fd = self._fd = None

    def hand_over(self, scheduler: str, job_id: str) -> None:
        """The run dir now belongs to a scheduler job (the launcher exits, the job runs on): the record
        names the job, and this process no longer releases the lock on exit."""
        holder = Holder(**{**asdict(self.holder), "scheduler": scheduler, "job_id": str(job_id)})
        # same token: still ours, written whole
        rundir.write_json(self.path, asdict(holder), indent=1, sort_keys=False, newline=True, mkdir=False)
        self.holder = holder
        self._released = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def judge(self, other: Holder, *, members: bool = True) -> str:
        """ "live", "stale" (holder gone: take over with a warning) or "ours" (our own job again).
        An elastic job's lock is live while any of its members is (`members`), whoever wrote the record."""
        if other.token == UNREADABLE:
            return "live"  # not ours to judge: someone must look at it
        if members and other.job and self.live_members(other.job):
            return "live"
        if flock_held(self.path):
            return "live"
        me = self.holder
        if other.scheduler and other.job_id:
            if other.scheduler == me.scheduler and other.job_id == me.job_id:
                return "ours"
            if self.job_alive is None:
                return "live"
            return "live" if self.job_alive(other.scheduler, other.job_id) else "stale"
        if other.host != me.host:
            return "live"
        if other.boot and me.boot and other.boot != me.boot:
            return "stale"  # the machine rebooted since: no process of then survives
        if not pid_alive(other.pid):
            return "stale"
        if other.pid_start is not None and pid_start_time(other.pid) not in (None, other.pid_start):
            return "stale"  # the pid was reused by another process
        return "live"

    def __enter__(self) -> RunLock:
        return self if not self._released else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- internals ---------------------------------------------------------------------------

    def _create(self) -> bool:
        """Write our record to a new lock file; False when one exists already."""
        fd = _create_record(self.path, self.holder)
        if fd is None:
            return False
        self._fd = fd
        return True

    def _owned(self) -> RunLock:
        self._released = False
        atexit.register(self.release)
        return self

    def _say(self, line: str) -> None:
        print(line, file=self.warn or sys.stderr, flush=True)

    def _guard(self) -> _Guard:
        return _Guard(self.run_dir / GUARD_NAME)


def _create_record(path: Path, holder: Holder) -> int | None:
    """A new file holding `holder`'s record, flocked for as long as the returned fd stays open; None
    when the file exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, (json.dumps(asdict(holder), indent=1) + "\n").encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a prober (flock_held) holds it for an instant at most
        except OSError:
            pass  # no flock on this filesystem: the record alone rules
    return fd


def slot_live(path: Path, me: Holder) -> bool:
    """Whether the member that wrote node slot `path` is still there: its flock where the filesystem has
    flock, else its pid on this host; a member on another host without flock counts as live."""
    member = read_holder(path)
    if member is None:
        return False
    if member.token == UNREADABLE:
        return True
    held = flock_held(path)
    if held is not None:
        return held
    if member.host != me.host:
        return True
    if member.boot and me.boot and member.boot != me.boot:
        return False
    return pid_alive(member.pid) and (
        member.pid_start is None or pid_start_time(member.pid) in (None, member.pid_start)
    )


class _Guard:
    """flock on RUN_DIR/.lock.guard for the few lines that replace a stale lock; yields False when
    the filesystem has no flock (the caller then refuses instead of racing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> bool:
        if fcntl is None:
            return False
        # O_NOFOLLOW: a guard name linked out of the run dir is never created or opened through the link
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # held for microseconds by a live process; dies with it
        except OSError as error:
            if error.errno in NO_FLOCK:
                return False
            raise
        return True

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def release_for_job(run_dir: str | os.PathLike[str], scheduler: str, job_id: str) -> bool:
    """A scheduler job that finished releases the run dir it was handed (see RunLock.hand_over);
    True when the lock named this job and is now gone. Any other holder's lock is left alone."""
    path = Path(run_dir) / LOCK_NAME
    current = read_holder(path)
    if current is None or (current.scheduler, current.job_id) != (scheduler, str(job_id)):
        return False
    path.unlink(missing_ok=True)
    return True


def acquire(run_dir: str | os.PathLike[str], **kwargs: Any) -> RunLock:
    """Own `run_dir` (BadInput naming the holder if a live job owns it); released at exit."""
    return RunLock(run_dir, **kwargs).acquire()
