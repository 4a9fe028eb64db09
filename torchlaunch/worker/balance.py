"""A slow rank gets fewer of the exact grid's micro-batches (train.balance), so it costs the job its own
share of the work rather than the job's pace.

Why it is safe: on the grid (worker/grid.py) a step's bits do not depend on which rank computed which
micro-batch, so moving micro-batches between ranks changes no bit of the model; only the time changes.

How: every step each rank measures its seconds per micro-batch (its compute, not its waits), and the
grid's first collective, which every rank joins anyway, carries them (GridStep.agree): every rank sees
the same numbers and runs this same arithmetic, so all reach the same decision at the same step with
no message of their own. A rank's pace is the median of its steps since the last move: at least
WINDOW (one hiccup moves nothing), at most the last HISTORY (steadier once the counts settle). When
the counts that minimise the slowest rank's time (each rank keeping at least one micro-batch, so it is
still measured) promise a step at least QUICK_GAIN shorter than the current counts after WINDOW steps,
or GAIN after HISTORY, the next step uses them, and the steps since the last move start again. A rank that recovers is
given its micro-batches back the same way.

Found within WINDOW steps of the slowing, so within 5 (issue #55): the median of three turns with the
second slow step.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

WINDOW = 3
"""Steps since the last move before a decision: their median pace, so a single slow step (a page fault,
a checkpoint's copy) moves nothing, and a slowing is seen at its second step."""
HISTORY = 8
"""At most this many steps since the last move are read: a steadier median once the counts settle."""
GAIN = 0.10
"""The predicted step must be at least this much shorter, over HISTORY steps since the last move: noise
of a few percent never moves work."""
QUICK_GAIN = 0.25
"""A gain this large moves work after WINDOW steps already (a rank at half speed promises ~30%): a real
straggler is found fast, while the refinements of the counts wait for the steadier median (measured:
with one threshold after 3 steps, pace noise on a loaded box moved 12/4 -> 10/6 -> 11/5 -> 12/4)."""


def best_counts(paces: Sequence[float], grid: int) -> tuple[int, ...]:
    """Micro-batches per rank (each >= 1, summing to `grid`) that minimise max(count x pace): each one
    after the first goes to the rank that would finish it soonest (optimal for this min-max; ties to
    the lower rank, so every rank computes the same answer)."""
    world = len(paces)
    counts = [1] * world
    for _ in range(grid - world):
        r = min(range(world), key=lambda k: ((counts[k] + 1) * paces[k], k))
        counts[r] += 1
    return tuple(counts)


def step_time(counts: Sequence[int], paces: Sequence[float]) -> float:
    """The predicted step: the slowest rank's count x pace."""
    return max(c * p for c, p in zip(counts, paces, strict=True))


class Balance:
    """One run's micro-batch counts, moved when the ranks' paces say so (see the module's docstring)."""

    def __init__(self, grid: int, world: int) -> None:
        self.grid = grid
        self.restart(world)

    def restart(self, world: int, counts: Sequence[int] = ()) -> None:
        """A new group (or new counts): the even split unless `counts`, and a fresh window."""
        base, extra = divmod(self.grid, world)
        self.counts: tuple[int, ...] = tuple(counts) or tuple(base + (r < extra) for r in range(world))
        self._paces: deque[list[float]] = deque(maxlen=HISTORY)

    def observe(self, seconds_per_micro_batch: Sequence[float]) -> tuple[int, ...] | None:
        """One step's paces (every rank's, the same list on every rank); the new counts when they should
        change from the next step on, else None."""
        if len(seconds_per_micro_batch) != len(self.counts) or min(seconds_per_micro_batch) <= 0:
            return None  # a step some rank did not time (a dropped step, a rank with no part)
        self._paces.append(list(seconds_per_micro_batch))
        if len(self._paces) < WINDOW:
            return None
        paces = [statistics.median(step[r] for step in self._paces) for r in range(len(self.counts))]
        proposed = best_counts(paces, self.grid)
        gain = 1.0 - step_time(proposed, paces) / step_time(self.counts, paces)
        if proposed == self.counts or gain < (GAIN if len(self._paces) >= HISTORY else QUICK_GAIN):
            return None
        self.restart(len(self.counts), proposed)
        return proposed
