"""Processes of one network namespace, read from /proc.

A node's processes are found by the network namespace they live in, not by parentage: kill -9 of a
torchrun agent leaves its workers orphaned (reparented to init), yet they stay in the namespace.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    """One live (non-zombie) process as /proc showed it."""

    pid: int
    ppid: int
    cmdline: tuple[str, ...]

    def runs_module(self, *needles: str) -> bool:
        """True when any argv word contains one of `needles` (e.g. 'torch.distributed.run')."""
        return any(needle in word for word in self.cmdline for needle in needles)


def _read_proc(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        # "pid (comm) state ppid ...": comm may contain spaces or parentheses, so split after the last ')'.
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state in ("Z", "X"):
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return Proc(pid=pid, ppid=int(ppid), cmdline=argv)


def netns_inode(netns_path: str) -> int:
    """Inode of a namespace file (e.g. /run/netns/NAME); /proc/PID/ns/net links show the same number."""
    return os.stat(netns_path).st_ino


def processes_in_netns(inode: int) -> list[Proc]:
    """Every live process whose network namespace has this inode."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            link = os.readlink(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if link == f"net:[{inode}]":
            proc = _read_proc(int(entry))
            if proc is not None:
                found.append(proc)
    return found


def children(procs: list[Proc], parent: int) -> list[Proc]:
    return [p for p in procs if p.ppid == parent]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    """Send `sig` to each pid, ignoring ones that are already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_netns_processes(inode: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL everything in the namespace until nothing is left; returns the pids killed.

    Loops because a dying parent may fork between listing and killing (torchrun restarting workers).
    """
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [p.pid for p in processes_in_netns(inode)]
        if not pids:
            return sorted(killed)
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} survived SIGKILL for {timeout_s}s")
        signal_all(pids, signal.SIGKILL)
        killed.update(pids)
        time.sleep(0.02)  # poll interval for the kernel to tear them down, bounded by the deadline
