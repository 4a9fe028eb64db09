"""A rank's liveness as its node's agent sees it: one byte down a pipe per beat, and the agent's watch.

Why: a crashed rank's kernel closes its sockets, so its peers learn of the loss from the transport
error at once (failure.py). A *silent* rank (frozen by SIGSTOP, stuck in the kernel, descheduled for
good) keeps its sockets open: its peers' collective just waits, with no error, until `dist.timeout_s`.
The agent that started the rank watches its beats; when they stop for longer than the bound
(recovery.heartbeat_timeout_s) it SIGKILLs the rank's process group. That turns silence into the crash
the others already recover from (their collective fails with a transport error, the membership service
has already dropped the silent rank's heartbeats, the group re-forms), and it fences the silent rank
for good: a frozen rank that woke up later would otherwise hold a stale group's state beside the new one.

Why a pipe and a thread of the rank's own: the beat must say "this process is scheduled", not "this
step is progressing": a long checkpoint write or validation is not silence. The thread writes
non-blocking, so a rank never waits on its agent; a full pipe (the agent itself stopped) drops beats.
The rank says goodbye (BYE) before it leaves, so a rank that is finishing is never taken for silent;
a rank that dies closes its end, which ends the watch too (its exit is the agent's to report).

Why the agent also reads the rank's main-thread CPU time: the beat thread needs the GIL, and a call
that holds it stops the beats of a process that runs. A regroup's full gc.collect() (~190,000 objects
in a worker: ~80 ms of CPU) took 0.55 s under load and over 1 s on a rank held to a fifth of the CPU
(as a container's CPU quota holds it), and its agent killed a survivor that was merely slow. So a
rank whose main thread ran at least PROGRESS_SHARE of the time since its last sign of life is alive;
a frozen rank (stopped, stuck in the kernel, descheduled) runs nothing and is still silent at the bound.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BEAT = b"."
BYE = b"x"
"""The rank leaves on purpose: stop watching it."""
JOINED = b"j"
"""A rank started again (recovery.rejoin) is in the live group now."""
BEATS_PER_BOUND = 10
"""Beats per bound: one late beat never makes a rank silent."""
PROGRESS_SHARE = 0.01
"""The least share of the time since a rank's last sign of life its main thread must have run to be
alive without a beat: a rank held to a fifth of a loaded CPU runs several percent; a thread waiting
for the GIL wakes every 5 ms for microseconds (~0.1%); a stopped one runs nothing."""


class Pulse:
    """The rank's side: a daemon thread writing BEAT to `fd` every `interval_s`, BYE on stop()."""

    def __init__(self, fd: int, interval_s: float) -> None:
        self.fd, self.interval_s = fd, interval_s
        os.set_blocking(fd, False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_bound(cls, fd: int, bound_s: float) -> Pulse:
        return cls(fd, bound_s / BEATS_PER_BOUND)

    def start(self) -> None:
        self._write(BEAT)
        self._thread = threading.Thread(target=self._beat, name="torchlaunch-pulse", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._write(BEAT):
                return

    def _write(self, data: bytes) -> bool:
        """False once the agent is gone (its end closed): nothing is left to tell."""
        try:
            os.write(self.fd, data)
        except BlockingIOError:  # the agent is not reading (itself stopped): this beat is dropped
            return True
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.EBADF):
                return False
            raise
        return True

    def joined(self) -> None:
        """Tell the agent this rank, started again, has joined the live group."""
        self._write(JOINED)

    def stop(self) -> None:
        """BYE, then close: the agent stops watching this rank (it is leaving on purpose)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._write(BYE)
        try:
            os.close(self.fd)
        except OSError:
            pass


def main_thread_cpu_s(pid: int) -> float | None:
    """CPU seconds the main thread of `pid` has run (/proc/PID/schedstat, in ns); None where unreadable
    (the process is gone, or no such file): the agent then judges by beats alone."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Watched:
    fd: int
    last_beat: float | None = None
    """monotonic time of the last sign of life (a beat read, or the main thread seen running); None
    until the first beat (start-up is not watched)."""
    pid: int | None = None
    ran_s: float | None = None
    """The main thread's CPU seconds at `last_beat` (None: not known, beats alone count)."""


@dataclass
class Watch:
    """The agent's side: each rank's read end, and which ranks have been silent past `bound_s`."""

    bound_s: float
    ranks: dict[int, Watched] = field(default_factory=dict)
    joined: set[int] = field(default_factory=set)
    """Ranks started again that said JOINED (reset when a rank's pipe is added again)."""
    cpu_s: Callable[[int], float | None] = main_thread_cpu_s

    def add(self, rank: int, fd: int) -> None:
        os.set_blocking(fd, False)
        self.forget(rank)
        self.joined.discard(rank)
        self.ranks[rank] = Watched(fd)

    def follow(self, rank: int, pid: int) -> None:
        """The process that holds `rank`'s pipe: its main thread's running counts as a sign of life."""
        if rank in self.ranks:
            self.ranks[rank].pid = pid

    def silent(self, now: float | None = None) -> dict[int, float]:
        """Drain every pipe, then {rank: seconds since its last sign of life} for each rank silent past
        the bound. A rank that said BYE or closed its end is no longer watched; one that never beat yet
        is not judged (its start-up, before it joined the group)."""
        read_at = time.monotonic() if now is None else now
        for rank, watched in list(self.ranks.items()):
            data, closed = _drain(watched.fd)
            if JOINED in data:
                self.joined.add(rank)
            ran = self.cpu_s(watched.pid) if watched.pid is not None else None
            if data.replace(BYE, b""):
                watched.last_beat, watched.ran_s = read_at, ran
            elif _ran_since(watched, ran, read_at):
                watched.last_beat, watched.ran_s = read_at, ran
            if BYE in data or closed:
                self.forget(rank)
        return {
            rank: read_at - w.last_beat
            for rank, w in self.ranks.items()
            if w.last_beat is not None and read_at - w.last_beat > self.bound_s
        }

    def forget(self, rank: int) -> None:
        watched = self.ranks.pop(rank, None)
        if watched is not None:
            try:
                os.close(watched.fd)
            except OSError:
                pass

    def close(self) -> None:
        for rank in list(self.ranks):
            self.forget(rank)


def _ran_since(watched: Watched, ran: float | None, now: float) -> bool:
    """Whether the rank's main thread ran at least PROGRESS_SHARE of the time since its last sign of life."""
    if ran is None or watched.ran_s is None or watched.last_beat is None:
        return False
    return ran - watched.ran_s > PROGRESS_SHARE * (now - watched.last_beat)


def _drain(fd: int) -> tuple[bytes, bool]:
    """Everything waiting in a non-blocking pipe, and whether its writer closed it (end of file)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return b"".join(chunks), False
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
