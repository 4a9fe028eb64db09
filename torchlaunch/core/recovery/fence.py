"""The run dir's group generation: one group trains a run dir at a time.

Every group that forms on a run dir (the first, and each regroup) takes the next generation from
RUN_DIR/live/generation under an exclusive lock, so generations only grow, also across membership
service restarts (whose quorum ids start again at 1) and job restarts. A rank checks its group's
generation against the file before every checkpoint commit, and again under the lock around the
commit's renames (holding): a rank left out of the live group (or an old group that has not noticed it
was replaced) finds a newer generation there and may not commit, however the two interleave.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.exit_codes import BadInput


class Fenced(BadInput):
    """This group was superseded: another group trains the run dir. Never retried (exit 2)."""


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
            fd = os.open("generation", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP):  # none yet, or a planted link: vouches for no group
                return 0
            raise
        finally:
            os.close(folder)
        with os.fdopen(fd, "rb") as fh:
            text = fh.read(32).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """RUN_DIR/live/generation.lock held exclusively; yields the folder's descriptor. The folder, its
        lock and the file are opened without following links (rundir.open_folder, O_NOFOLLOW): a link
        planted at RUN_DIR/live is LinkedFolder (an OSError), and nothing is written through it."""
        self.folder.mkdir(exist_ok=True)
        folder = rundir.open_folder(self.folder)
        try:
            lock = os.open(
                "generation.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder
            )
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                yield folder
            finally:
                os.close(lock)
        finally:
            os.close(folder)

    def advance(self) -> int:
        """Take the next generation for a group that just formed; returns it."""
        with self._locked() as folder:
            generation = self.current() + 1
            rundir.write_text("generation", f"{generation}\n", real_folder=True, dir_fd=folder)
            return generation

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
