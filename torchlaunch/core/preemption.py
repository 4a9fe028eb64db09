"""Preemption: a signal only sets a flag; ranks agree at step boundaries; nothing saves in a handler.

Saving inside a signal handler can deadlock (the handler may interrupt a collective or the allocator)
and only the signalled rank would save. Instead every rank polls `requested` at each step boundary
and the ranks all-reduce it, so when any rank was signalled all of them checkpoint the same step.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchlaunch.core.dist import DistContext


class PreemptionWatcher:
    """Installs flag-setting handlers for the configured signals; restore() puts the old ones back."""

    def __init__(self, signal_names: list[str]) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread
        for name in signal_names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
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
