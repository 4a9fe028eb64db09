"""What /proc says about a process: alive, the same process as recorded (start time), its state,
its parent. The one reader of /proc/PID/stat.

A pid from a record is data: before anything is signalled, its start time must match the one recorded
with it, so a recycled pid (or a forged one) is never signalled. Linux only; elsewhere every answer is
"unknown" and nothing is signalled. Beside it, the one bounded runner of a scheduler's query tools.
"""

from __future__ import annotations

import shutil
import subprocess

STOPPED_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a tracer", "D": "in uninterruptible I/O (D)"}
"""Process states in which a signal is not acted on, so no stack can be asked for."""


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3, the state, onward): the command name
    is in parentheses and may hold spaces, ')' or bytes that are not UTF-8, so split after the last ')'.
    None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stream:
            text = stream.read()
    except (OSError, ValueError):
        return None
    _, sep, rest = text.rpartition(")")
    return rest.split() if sep else None


def parent(pid: int | str) -> int | None:
    """The parent pid of `pid` (field 4); None if it is gone or off Linux."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 and fields[1].isdigit() else None


def state(pid: int | str) -> str | None:
    """The one-letter process state (R, S, D, T, Z...) or None when there is no such process."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def start_ticks(pid: int | str) -> int | None:
    """The process start time in clock ticks since boot: with the pid, it names one process."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def same_process(pid: int | None, ticks: int | None) -> bool:
    """True when `pid` runs and started at `ticks` (never for pid 1 or unknown values)."""
    if pid is None or ticks is None or pid <= 1:
        return False
    return start_ticks(pid) == ticks and state(pid) not in (None, "Z", "X")


def unresponsive(pid: int) -> str | None:
    """Why `pid` cannot act on a signal now (stopped, D state), else None."""
    return STOPPED_STATES.get(state(pid) or "")


TOOL_TIMEOUT_S = 10.0
"""How long a scheduler tool may take to answer one query."""


def tool_output(argv: list[str], timeout: float = TOOL_TIMEOUT_S) -> str | None:
    """A scheduler tool's stdout (squeue, sacct, kubectl); None when the tool is missing, fails or
    times out: the operator commands then say what they cannot know, and never hang on a dead controller."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def end(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM a child that still runs, SIGKILL it after grace_s, and reap it: the membership services the
    node agents start (a standby or a serving Lighthouse) end so, whoever ends them."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
