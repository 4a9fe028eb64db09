"""Someone else's code called with a time bound and an error fence: a plug-in's import, its hooks, a data
factory.

Why a thread and not a child process: the answer is a live object (a backend, a dataset) that must be
used in this process, and the callers run where no process may be started (the operator commands under
a second, the unit floor). The thread is a daemon: a call that overruns is left behind, still running,
and the caller goes on with one line; the process can exit past it (a non-daemon thread, as
concurrent.futures makes, would hold the exit until the hang ends, i.e. forever). Every way the code can
end badly, SystemExit and KeyboardInterrupt raised by it included, comes back as one Failed: a plug-in
never ends the process it was loaded into, nor says only a bare exit code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Failed(Exception):
    """The call raised (any BaseException) or did not return in time; str() is one line saying which."""

    def __init__(self, what: str, timed_out: bool = False, error: BaseException | None = None) -> None:
        super().__init__(what)
        self.timed_out = timed_out
        self.error = error
        """What the call raised (None when it timed out): a caller passes its own kind of error on."""


def describe(error: BaseException) -> str:
    """`Type: first line of the message`, at most 200 characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text[:200]


def call(fn: Callable[[], T], timeout_s: float, name: str = "plug-in") -> T:
    """fn() in a daemon thread: its value, or Failed naming why not (what it raised, or that it did not
    return within `timeout_s`)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - SystemExit from a plug-in is a failure, not our exit
            box["error"] = error

    thread = threading.Thread(target=run, name=f"bounded {name}"[:60], daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Failed(f"did not return within {timeout_s:g} s", timed_out=True)
    if "error" in box:
        error: BaseException = box["error"]  # type: ignore[assignment]
        raise Failed(f"raised {describe(error)}", error=error)
    return box["value"]  # type: ignore[return-value]
