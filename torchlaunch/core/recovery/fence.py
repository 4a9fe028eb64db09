"""The run dir's group generation: one group trains a run dir at a time.

Every group that forms on a run dir (the first, and each regroup) takes the next generation from
RUN_DIR/live/generation under an exclusive lock, so generations only grow, also across membership
service restarts (whose quorum ids start again at 1) and job restarts. A rank checks its group's
generation against the file before every checkpoint commit: a rank left out of the live group (or an
old group that has not noticed it was replaced) finds a newer generation there and may not commit.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.exit_codes import BadInput


class Fenced(BadInput):
    """This group was superseded: another group trains the run dir. Never retried (exit 2)."""


class Fence:
    """RUN_DIR/live/generation, read and advanced under RUN_DIR/live/generation.lock."""

    def __init__(self, run_dir: str | Path) -> None:
        self.folder = Path(run_dir) / "live"
        self.path = self.folder / "generation"
        self.lock_path = self.folder / "generation.lock"

    def current(self) -> int:
        """The newest generation (0 before any group formed)."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return 0
        return int(text) if text.isdigit() else 0

    def advance(self) -> int:
        """Take the next generation for a group that just formed; returns it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            generation = self.current() + 1
            rundir.write_text(self.path, f"{generation}\n")
            return generation

    def check(self, generation: int, what: str = "commit a checkpoint") -> None:
        """Raise Fenced unless `generation` is still the newest."""
        newest = self.current()
        if newest != generation:
            raise Fenced(
                f"live error: this group (generation {generation}) may not {what}: generation {newest} trains "
                f"{self.folder.parent} now; this rank leaves without writing"
            )
