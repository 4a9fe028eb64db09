"""What a long start-up is doing, said by rank 0 while it does it.

Why: the CIFAR-10 recipe on a class-folder tree was silent for 2.5 minutes on a CPU (decoding 50,000
images into the cache, then the model) while `status` showed `step -`: a new user could not tell a
slow start from a hang. A phase that lasts past AFTER_S gets one line (`start-up: preparing the data
(...) for 5 s ...`); quick phases say nothing, so a normal start's output is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

AFTER_S = 5.0
"""A phase shorter than this is a normal start (the smoke recipe's take < 1 s each)."""


class Timer(Protocol):
    def start(self) -> None: ...
    def cancel(self) -> None: ...


def _thread_timer(delay_s: float, fn: Callable[[], None]) -> Timer:
    timer = threading.Timer(delay_s, fn)
    timer.daemon = True  # never holds the process up
    return timer


def _say(line: str) -> None:
    print(line, flush=True)


class Phases:
    """`with phases("preparing the data (...)"):` around each slow part of the start; only `speaks`
    (global rank 0: one line for the run, not one per rank) ever prints."""

    def __init__(
        self,
        speaks: bool,
        after_s: float = AFTER_S,
        timer: Callable[[float, Callable[[], None]], Timer] = _thread_timer,
        say: Callable[[str], None] = _say,
    ) -> None:
        self.speaks, self.after_s, self._timer, self._say = speaks, after_s, timer, say

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        if not self.speaks:
            yield
            return
        timer = self._timer(self.after_s, lambda: self._say(f"start-up: {what} for {self.after_s:.0f} s ..."))
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
