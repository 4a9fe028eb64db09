"""The run dir's group generation: one group trains a run dir at a time.

Every group that forms on a run dir (the first, and each regroup) takes the next generation from
RUN_DIR/live/generation under an exclusive lock, so generations only grow, also across membership
service restarts (whose quorum ids start again at 1) and job restarts. A rank checks its group's
generation against the file before every checkpoint commit, and again under the lock around the
commit's renames (holding): a rank left out of the live group (or an old group that has not noticed it
was replaced) finds a newer generation there and may not commit, however the two interleave.

The same file tells a node's launcher whether it starts the job or replaces a lost node of a job that
trains: the launcher that founds a job's run (no other launcher of the job alive, runlock) records the
generation it found (RUN_DIR/live/founded); a launcher that comes later finds the generation grown past
it once the job's first group formed, and starts its ranks as joiners, which take a live peer's state
(a first group needs every node, so no node of the first launch can find it grown). The record names
its founder's lock token: a launcher that joins before the founder has written it (the founder records
once its config is settled) waits for it rather than read an earlier launch's record as this one's.

The lock is a flock, which belongs to the open file description, and fork shares that description with
the child. A loader worker forked while the checkpoint writer held the lock (a new epoch's loader, a
regroup's) kept it held after the writer closed its descriptor, until the worker exited: the next
commit waited on it while the training thread, its epoch's loader still alive, waited on the commit
(issue #51: the hang watchdog ended the job after 10 minutes). So a forked child closes its copies at
once (never LOCK_UN, which would release the parent's lock), the holder releases with LOCK_UN before it
closes (whoever else has a copy), and nobody waits on the lock past LOCK_BOUND_S (FenceBusy, not a hang).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.base import storage
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BadInput

FOUNDED = "founded"

LOCK_BOUND_S = 120.0
"""How long a rank waits for the fence's lock before it gives up (FenceBusy) rather than hang. Its holders
keep it for a commit's renames or a generation's write: milliseconds, seconds on slow shared storage.
Longer means a holder that is stuck itself (a hung file server, a process that kept a copy), which no
wait cures; the hang watchdog would end the job only after 10 minutes, saying less."""

_POLL_MAX_S = 0.01
"""The longest pause between two tries for a held lock: a regroup waiting behind a commit loses at most this."""

_open_locks: set[int] = set()
"""This process's descriptors of fence locks, closed in every child it forks (_close_in_child)."""
_opening = threading.Lock()
"""Held from a lock's open until it is in _open_locks, and by every fork (_before_fork): no child is
forked between the two, with a copy it would not know to close."""


def _before_fork() -> None:
    _opening.acquire()


def _after_fork_in_parent() -> None:
    _opening.release()


def _close_in_child() -> None:
    """A forked child (a loader worker) drops its copies of the fence's lock descriptors: with a copy
    open, the lock would outlive its holder's release (a writer that closes) and its holder's death."""
    global _opening
    _opening = threading.Lock()  # the parent's, held by the fork, is never released in the child
    for fd in _open_locks:
        try:
            os.close(fd)  # not LOCK_UN: that would release the parent's lock, which it still holds
        except OSError:
            pass
    _open_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_close_in_child)


class FenceBusy(RuntimeError):
    """The fence's lock stayed held past LOCK_BOUND_S. Exit 1, not 2: the run dir is not at fault, and once
    the holder ends a retry finds the lock free."""


class Fenced(BadInput):
    """This group was superseded: another group trains the run dir. Never retried (exit 2)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        global _left_out
        _left_out = True


_left_out = False


def left_out() -> bool:
    """Whether this process's group was fenced (a Fenced made here). A Slurm task, which runs its rank in
    its own process, records it: the job's verdict counts a left-out task as lost, not as the job's bad
    input (its exit 2 keeps it from being retried or replaced)."""
    return _left_out


class Fence:
    """RUN_DIR/live/generation, read and advanced under RUN_DIR/live/generation.lock."""

    def __init__(self, run_dir: str | Path) -> None:
        self.folder = rundir.live(run_dir)
        self.path = self.folder / "generation"
        self.lock_path = self.folder / "generation.lock"

    def current(self) -> int:
        """The newest generation (0 before any group formed). Read through the real folder, never a
        link: a generation file planted elsewhere cannot vouch for a group."""
        try:
            folder = rundir.open_folder(self.folder)
        except FileNotFoundError:
            return 0
        try:
            return self._read("generation", folder)
        finally:
            os.close(folder)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """RUN_DIR/live/generation.lock held exclusively; yields the folder's descriptor. The folder, its
        lock and the file are opened without following links (rundir.open_folder, O_NOFOLLOW): a link
        planted at RUN_DIR/live is LinkedFolder (an OSError), and nothing is written through it."""
        self.folder.mkdir(exist_ok=True)
        folder = rundir.open_folder(self.folder)
        try:
            with _opening:
                lock = os.open(
                    "generation.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder
                )
                _open_locks.add(lock)
            try:
                self._take(lock)
                try:
                    yield folder
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)  # released, whatever else shares the description
            finally:
                _open_locks.discard(lock)
                os.close(lock)
        finally:
            os.close(folder)

    def _take(self, lock: int) -> None:
        """flock(LOCK_EX) on `lock`, waiting at most LOCK_BOUND_S (tries without blocking: a blocking flock
        cannot be bounded from a thread), else FenceBusy naming the holder where /proc/locks tells."""
        deadline = time.monotonic() + LOCK_BOUND_S
        pause = 0.0005
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass  # raised outside the handler: no OSError in its chain (store.write_checkpoint reads it)
            if time.monotonic() >= deadline:
                raise FenceBusy(
                    f"live error: {self.lock_path} stayed locked for {LOCK_BOUND_S:g} s{_holder(lock)}; a commit "
                    "or regroup takes it for milliseconds: its holder is stuck (this rank gives up rather than hang)"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def found(self, founder: str = "") -> None:
        """The launcher that starts the job: the generation now is the job's start line, recorded with
        the founder's lock token (runlock.Holder.token), so a later launcher can tell this job's record
        from an earlier launch's that the founder has not replaced yet (`founder`)."""
        with self._refusing(FOUNDED), self._locked() as folder:
            line = f"{self._read('generation', folder)} {founder}".strip()
            rundir.write_text(FOUNDED, f"{line}\n", real_folder=True, dir_fd=folder)

    def founder(self) -> str:
        """The lock token of the launcher that wrote the founded record ('' when none, or a record of
        a version that kept no token, or one planted as a link)."""
        try:
            folder = rundir.open_folder(self.folder)
        except FileNotFoundError:
            return ""
        try:
            fields = self._text(FOUNDED, folder).split()
            return fields[1] if len(fields) == 2 and whole(fields[0]) is not None else ""
        finally:
            os.close(folder)

    def formed_since_founded(self) -> bool:
        """Whether a group of the job that was founded last has formed: a launcher that joins it now
        replaces a lost node. False when no launcher founded one (a run dir from before live mode)."""
        try:
            folder = rundir.open_folder(self.folder)
        except FileNotFoundError:
            return False
        try:
            founded = self._read(FOUNDED, folder, missing=-1)
            return founded >= 0 and self._read("generation", folder) > founded
        finally:
            os.close(folder)

    def _read(self, name: str, folder: int, missing: int = 0) -> int:
        """A number file of the folder (its first field: the founded record also names its founder),
        opened without following links (a planted link reads as missing), or `missing`."""
        fields = self._text(name, folder).split()
        number = whole(fields[0]) if fields else None
        return number if number is not None else missing

    def _text(self, name: str, folder: int) -> str:
        """A small file of the folder, '' when missing or a link (never followed)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP):
                return ""
            raise
        with os.fdopen(fd, "rb") as fh:
            return fh.read(128).decode("ascii", "replace").strip()

    def advance(self, succeeds: int = 0) -> int:
        """Take the next generation for a group that just formed; returns it. `succeeds`: the newest
        generation any of its members trained in (0: a first group, none did). A regroup continues the
        run only if one of its members was in the newest group: members that all come from an older one
        (a node frozen or cut off past the bound, woken after the others regrouped without it, or after
        they finished) hold a superseded group's state, and taking a generation would fence the group that
        trains (or retrain the tail of a finished run over its files). Fenced, decided under the lock."""
        with self._refusing("generation"), self._locked() as folder:
            newest = self.current()
            if 0 < succeeds < newest:
                raise Fenced(
                    f"live error: this group's members come from generation {succeeds}, but generation {newest} "
                    f"trains {self.folder.parent} (or finished it) without them: left out, this rank leaves "
                    "without writing"
                )
            generation = newest + 1
            rundir.write_text("generation", f"{generation}\n", real_folder=True, dir_fd=folder)
            return generation

    @contextlib.contextmanager
    def _refusing(self, name: str) -> Iterator[None]:
        """The storage refusing a write of the fence's own files (full, read-only, over quota) is exit 2 and
        one line (base/storage.py), never a member gone: a regroup that retried it would fail the same way.
        A planted link stays rundir.LinkedFolder."""
        try:
            yield
        except OSError as e:
            if isinstance(e, rundir.LinkedFolder) or not storage.is_storage(e):
                raise
            raise storage.refusal(
                e, self.folder / name, prefix="live error: storage: ", what="writing the live group's"
            ) from None

    @contextlib.contextmanager
    def holding(self, generation: int, what: str = "commit a checkpoint") -> Iterator[None]:
        """Check `generation` and keep the lock while the caller commits: a newer group cannot take its
        generation between this check and the commit (advance waits for the lock; a commit's renames
        take milliseconds), and once it has, this group's check fails. Fenced when superseded."""
        with self._locked():
            self.check(generation, what)
            yield

    def check(self, generation: int, what: str = "commit a checkpoint") -> None:
        """Raise Fenced unless `generation` is still the newest."""
        newest = self.current()
        if newest != generation:
            raise Fenced(
                f"live error: this group (generation {generation}) may not {what}: generation {newest} trains "
                f"{self.folder.parent} now; this rank leaves without writing"
            )


def _holder(lock: int) -> str:
    """' (held by pid N)' for the process /proc/locks names as holding `lock`'s file, '' where unknown."""
    try:
        st = os.fstat(lock)
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return ""
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and whole(fields[4]) is not None:
            return f" (held by pid {fields[4]})"
    return ""
