"""How long this process has existed: the start-up figure the worker reports.

Measured from the kernel's record of the process start (/proc/self/stat), so interpreter start-up and
every import count, not only what runs after `train` is imported. No torch here: imported first.
"""

from __future__ import annotations

import os
import time

from torchlaunch.base import procs

_FALLBACK_T0 = time.monotonic()
"""Where /proc is missing (not Linux): the time this module was imported, the earliest we can see."""


def process_age_s() -> float:
    """Seconds since this process was started (10 ms resolution on Linux: clock ticks)."""
    start_ticks = procs.start_ticks("self")  # field 22, starttime: clock ticks after boot
    if start_ticks is None:
        return time.monotonic() - _FALLBACK_T0
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _FALLBACK_T0
