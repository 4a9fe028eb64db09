"""Children die with the launcher: no torchrun agent or worker trains on after `launch.local` is killed.

A SIGKILLed launcher runs no cleanup, and torchrun starts each worker in a session of its own
(torch.distributed.elastic's SubprocessHandler: `start_new_session=True`, no PR_SET_PDEATHSIG), so
neither a process-group kill nor the terminal's hangup reaches them. The chain that does:

    launch.local --Popen(preexec_fn=die_with_parent())--> torchrun agent      (dies with the launcher)
    torchrun agent --Popen(start_new_session)-----------> worker: runner calls die_with_parent_now()
                                                                             (dies with the agent)

- `die_with_parent(sig)`: a `preexec_fn` for subprocess.Popen. In the child, between fork and exec, it
  sets prctl(PR_SET_PDEATHSIG, sig) (kept across exec for a non-setuid program), then checks that the
  parent is still the launcher: a launcher that died before the prctl took effect would otherwise
  leave the child orphaned for good (the documented race), so the child kills itself at once.
- `die_with_parent_now(sig)`: the same for the calling process itself, for code that runs inside a
  child it did not start (the rank runner inside torchrun's workers).
- Off Linux there is no PDEATHSIG: `die_with_parent_now` starts a daemon thread that watches
  getppid() and kills the process when it changes, and `die_with_parent` returns None (no preexec_fn;
  the child's own runner then watches).
- `descendants` / `kill_tree`: what a launcher that is still alive (an exception, a second Ctrl-C)
  uses to end the whole tree, since the workers are in their own sessions: walk /proc by ppid.

The kernel sends the death signal when the parent *thread* that forked the child exits; the launcher
and torchrun both fork from their main thread, so that is the process's death. SIGKILL is the default:
an orphaned worker has no agent left to rendezvous with or restart it, so there is nothing to save
by letting it run its preemption path (the checkpoint on disk is the resume point).

Stdlib + ctypes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from torchlaunch import contract
from torchlaunch.base import procs
from torchlaunch.base.untrusted import whole

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
WATCH_INTERVAL_S = 0.5
"""Poll period of the non-Linux watcher (there is no event for a parent's death there)."""

_libc: ctypes.CDLL | None = None


def supported() -> bool:
    """True where the kernel can send a signal on the parent's death (Linux prctl)."""
    return sys.platform.startswith("linux") and _prctl_function() is not None


def _prctl_function() -> Callable[..., int] | None:
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            # The process's own symbols, libc's among them: find_library('c') would start ldconfig.
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    prctl = getattr(_libc, "prctl", None)
    if prctl is not None:
        prctl.restype = ctypes.c_int
    return prctl


def set_pdeathsig(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) on the calling thread's process; False where unsupported or refused."""
    prctl = _prctl_function()
    if prctl is None:
        return False
    return prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), 0, 0, 0) == 0


def get_pdeathsig() -> int | None:
    """The death signal currently set for this process (0: none); None where unsupported."""
    prctl = _prctl_function()
    if prctl is None:
        return None
    value = ctypes.c_int(0)
    if prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) != 0:
        return None
    return value.value


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` making the Popen child get `sig` when this (the calling) process dies.

    Built in the parent, so it knows the parent's pid; run in the child, it only calls prctl,
    getppid and kill (async-signal-safe enough for preexec_fn). None off Linux: pass it as is,
    `subprocess.Popen(..., preexec_fn=die_with_parent())`."""
    if not supported():
        return None
    _prctl_function()  # load libc in the parent, never between fork and exec
    parent = os.getpid()

    def preexec() -> None:
        set_pdeathsig(sig)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec


def die_with_parent_now(sig: int = signal.SIGKILL, *, parent: int | None = None) -> str:
    """Make the calling process get `sig` when its current parent dies; returns how ("prctl", "watcher", "orphan").

    `parent` is the pid the caller believes is its parent (default: getppid() now); if the process
    has already been reparented away from it, it is an orphan and `sig` is sent at once."""
    expected = os.getppid() if parent is None else parent
    if set_pdeathsig(sig):
        if os.getppid() != expected:
            os.kill(os.getpid(), sig)
            return "orphan"
        return "prctl"
    if os.getppid() != expected:
        os.kill(os.getpid(), sig)
        return "orphan"
    watcher = threading.Thread(target=_watch_parent, args=(expected, sig), name="die-with-parent", daemon=True)
    watcher.start()
    return "watcher"


def _watch_parent(parent: int, sig: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)  # polling: no portable event for "my parent died"
    os.kill(os.getpid(), sig)


def _parent_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        parent = procs.parent(entry)
        if parent is not None:  # else gone meanwhile
            children.setdefault(parent, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before children (Linux /proc; empty elsewhere)."""
    children = _parent_map()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop(0)
        for child in children.get(current, []):
            if child not in found:
                found.append(child)
                frontier.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL, *, include_root: bool = True) -> list[int]:
    """Send `sig` to `pid` and all its descendants (sessions do not matter); returns the pids signalled.

    The tree is read first, so processes reparented mid-way are still reached; children are signalled
    before the root so the root cannot restart them."""
    tree = descendants(pid)
    targets = [*reversed(tree), *([pid] if include_root else [])]
    signalled = []
    for target in targets:
        try:
            os.kill(target, sig)
        except (ProcessLookupError, PermissionError):
            continue
        signalled.append(target)
    return signalled


AGENT_ENV = contract.ELASTIC_RUN_ID
LAUNCHER_PID_ENV = contract.LAUNCHER_PID


def launcher_env() -> dict[str, str]:
    """What the launcher adds to torchrun's environment so each worker can tell it was orphaned early."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (/proc/PID/stat field 4); None if it is gone or off Linux."""
    return procs.parent(pid)


def die_with_agent(sig: int = signal.SIGKILL) -> str | None:
    """In a rank started by torchrun: die with the agent (returns how, see die_with_parent_now); None
    when not under torchrun (a Slurm task or the single worker, whose parent handles its death).

    A worker only runs this once its interpreter is up, and the agent may have died (with the
    launcher) before that: getppid() then already names the reaper, which looks like a live parent.
    So the agent's own parent must still be the launcher named in the environment."""
    if not contract.get(AGENT_ENV):
        return None
    how = die_with_parent_now(sig)
    launcher = whole(contract.get(LAUNCHER_PID_ENV, "") or "", 10)
    if how != "orphan" and launcher is not None and parent_of(os.getppid()) != launcher:
        os.kill(os.getpid(), sig)
        return "orphan"
    return how
