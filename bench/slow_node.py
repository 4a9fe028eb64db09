"""A node made slow from outside: its processes held to a share of the CPU by SIGSTOP and SIGCONT in
short turns, as a busier or slower machine would run them.

Why the live tests need it: their model steps in a few milliseconds on a CPU, while a rank started
again needs seconds to import torch and ask to join. On a fast box the survivor finished its run
before its peer came back ("started again, but the others finished first"), and the rejoin under test
never happened. A real job's step (hundreds of milliseconds on a GPU) is long against the same
start-up: slowing the survivors while a rank comes back restores that ratio, where a longer run would
only move the race (and make every reference run longer). Each stop lasts a few tens of milliseconds,
far below recovery.heartbeat_timeout_s, so the membership service never takes it for a loss.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import TracebackType

from torchlaunch import pdeath

TURN_S = 0.05
"""One stop + run cycle: short against the heartbeat bound (1 s) and the peer watch."""


class SlowNode:
    """While entered (and until `until()` says so), the process trees under `roots()` (read again each
    turn, so loader workers started later are held too) run `share` of each TURN_S and are stopped the
    rest. Every process stopped is continued on leaving, whatever happened."""

    def __init__(
        self,
        roots: Callable[[], Iterable[int]],
        share: float = 0.2,
        until: Callable[[], bool] = lambda: False,
        turn_s: float = TURN_S,
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.roots, self.share, self.until, self.turn_s = roots, share, until, turn_s
        self.turns = 0
        """Turns in which at least one process was held (a test can check the slowing took place)."""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="slow-node", daemon=True)

    def __enter__(self) -> SlowNode:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._done.set()
        self._thread.join()

    def _hold(self) -> None:
        ever: set[int] = set()
        try:
            while not self._done.is_set() and not self.until():
                held = [pid for root in self.roots() for pid in pdeath.kill_tree(root, signal.SIGSTOP)]
                ever.update(held)
                self.turns += bool(held)
                self._done.wait(self.turn_s * (1.0 - self.share))
                _continue(held)
                self._done.wait(self.turn_s * self.share)
        finally:
            _continue(ever)


def _continue(pids: Iterable[int]) -> None:
    """SIGCONT each process stopped (by pid: one whose parent died meanwhile is no longer in its tree)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
