"""Preemption: a signal only sets a flag; ranks agree at step boundaries; nothing saves in a handler.

Saving inside a signal handler can deadlock (the handler may interrupt a collective or the allocator)
and only the signalled rank would save. Instead every rank posts `requested` at each step boundary
and the ranks all-reduce it, so when any rank was signalled all of them checkpoint the same step.

Two forms: `agree` reads the agreed flags at once (a host synchronisation on CUDA: for check points
and user loops that ask once per step); `StepAgreement` posts each step's flag without waiting and
reads it a fixed number of steps later, or at the next check point, whichever comes first. Both
decide by step count alone, so every rank stops at the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from types import FrameType
from typing import TYPE_CHECKING, Any

from torchlaunch.stop_signals import taken_over

if TYPE_CHECKING:
    from torchlaunch.core.dist import DistContext, FlagMax, PendingMax


class PreemptionWatcher:
    """Installs flag-setting handlers for the configured signals; restore() puts the old ones back.

    The first stop signal sets the flag; later ones are the same stop and are not repeated (a scheduler
    that signals the batch shell and every task delivers it twice). A second SIGINT is a person pressing
    Ctrl-C again: it ends the run at once, without a checkpoint, as Python's own KeyboardInterrupt
    would. A forked child (a loader worker run without the rank runner's fork shield) never acts."""

    def __init__(self, signal_names: list[str]) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self.pid = os.getpid()
        self._interrupted_before = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread
        for name in signal_names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
            early = taken_over(self._previous[sig])
            if early is not None:  # a stop during start-up (stop_signals.EarlyStop): checkpoint as for any
                self._handle(early, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:
            return
        if signum == signal.SIGINT and self.signum is not None and self._interrupted_before:
            self.restore()
            raise KeyboardInterrupt("second Ctrl-C: stopped at once, without a checkpoint")
        self._interrupted_before = self._interrupted_before or signum == signal.SIGINT
        if self.signum is None:
            self.signum = signum
            self.received_at = time.monotonic()
            # os.write is async-signal-safe enough for CPython handlers; print() could re-enter.
            sys.stderr.write(f"received {signal.Signals(signum).name}: will checkpoint at the next step boundary\n")

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def agree(ctx: DistContext, requested: bool, *others: bool) -> tuple[bool, ...]:
    """(any rank requested a stop, any rank raised each other flag): one tiny all-reduce (max) that
    every rank must call at the same step boundary, so all of them checkpoint the same step."""
    from torchlaunch.core.dist import all_reduce_max  # torch stays out of this module's import

    flags = all_reduce_max(ctx, [1.0 if requested else 0.0, *(1.0 if f else 0.0 for f in others)])
    return tuple(f > 0 for f in flags)


class StepAgreement:
    """Per-step preemption agreement that never makes the host wait for the device between check points.

    `post(step, requested)` starts an all-reduce (max) of this rank's flag and returns at once (on
    CUDA the result is copied to pinned host memory behind the step's kernels). `read(through)` reads
    every posting of a step <= `through`: the caller passes its step at check points (where it reads
    the device anyway) and `step - lag` elsewhere, so by then the posting has long completed and the
    read does not drain the queue. Every rank posts and reads the same steps, so all see a stop at
    the same step: at most `lag` steps after the signal, or at the check point before that.
    Without a process group the flag is the watcher's, read directly.
    """

    def __init__(self, ctx: DistContext) -> None:
        self._pending: deque[tuple[int, bool | PendingMax]] = deque()
        self._reducer: FlagMax | None = None
        if ctx.distributed:
            from torchlaunch.core.dist import FlagMax  # torch stays out of this module's import

            self._reducer = FlagMax(ctx)

    def post(self, step: int, requested: bool) -> None:
        self._pending.append((step, self._reducer.post(requested) if self._reducer is not None else requested))

    def read(self, through: int) -> bool:
        """Whether any rank asked to stop at a posted step <= `through` (those postings are consumed)."""
        stop = False
        while self._pending and self._pending[0][0] <= through:
            _, posted = self._pending.popleft()
            stop = (posted if isinstance(posted, bool) else posted.result()) or stop
        return stop

    def drain(self) -> bool:
        """Read every posting (before leaving the loop: no collective is left in flight)."""
        return self.read(self._pending[-1][0]) if self._pending else False

    def forget(self) -> None:
        """Let go of every posting of a broken group (live mode, before it regroups): each holds its
        collective, which holds the group's connections open (worker/groups/live.loss_line). A stop asked for
        meanwhile is not lost: the watcher's flag stays set and is posted again on the new group."""
        self._pending.clear()
