"""A member silent to its peers (frozen, partitioned), judged by the peers themselves.

Why the peers: a whole node that freezes (SIGSTOP of every process, a hung kernel) or drops off the
network takes its live agent along, so nothing on it fences its ranks; its sockets stay open (or
silently dead), so the others' collective waits on it until dist.timeout_s without a transport error.

How: every rank answers a one-datagram echo (UDP, on its store's port number) from a process of its
own that answers only while the rank runs (echo_process.py); a frozen rank, or one out of reach, does not. While this rank's training has not stepped for
a quarter of the bound (recovery.heartbeat_timeout_s), a watcher thread asks each peer of the group;
a peer that gives no answer within the bound is judged silent, and this rank shuts its group's
connections down (live/sockets.py): its collective fails at once, every live member's does
too, and they regroup without the silent one, whose heartbeats to the membership service have lapsed
meanwhile. A long save or validation on a peer is no silence: its echo answers throughout, whatever holds its GIL.
A silent member that wakes finds its group gone and its generation superseded (fence.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from torchlaunch.live import echo_process

RESEND_S = 0.1
"""A lost datagram costs this much, not the whole bound."""


class Echo:
    """This rank's answer to its peers' probes: a UDP socket on every interface, served by a process of
    its own (echo_process.py: a thread needed the rank's GIL, and a long C call that kept it made a
    healthy rank look frozen) that sends each datagram back to where it came from while the rank runs."""

    def __init__(self, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind(("", port))
            self.port = int(self.sock.getsockname()[1])
            # born with a job's signals blocked (a mask survives exec): one sent before it ignores them
            # must not end it
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, echo_process.ignored())
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-I", "-S", echo_process.__file__, str(self.sock.fileno()), str(os.getpid())],
                    pass_fds=(self.sock.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)
        self.sock.close()


def answers(address: str, timeout_s: float) -> bool:
    """Whether the rank whose store is at HOST:PORT echoes a datagram within `timeout_s` (sent again
    every RESEND_S: a lost datagram is not silence)."""
    host, _, port = address.rpartition(":")
    nonce = os.urandom(8)
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]"), int(port)))
            while True:
                left = deadline - time.monotonic()
                if left > 0:
                    with contextlib.suppress(OSError):  # ICMP unreachable from an earlier send: try again
                        s.send(nonce)
                # past the deadline, one look without waiting: an answer that came while this thread
                # waited for its own GIL is an answer
                ready, _, _ = select.select([s], [], [], max(0.0, min(RESEND_S, left)))
                if ready:
                    with contextlib.suppress(OSError):
                        if s.recv(64) == nonce:
                            return True
                    continue
                if left <= 0:
                    return False
    except (OSError, ValueError):
        return False


class PeerWatch:
    """The watcher thread: while the group's training is stalled past a quarter of the bound, probe the peers;
    on the first silent one, call `cut` once for that group."""

    def __init__(self, bound_s: float, probe: Callable[[str, float], bool] = answers) -> None:
        self.bound_s, self._probe = bound_s, probe
        self._lock = threading.Lock()
        self._peers: tuple[str, ...] = ()
        self._cut: Callable[[], object] | None = None
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.judged: str | None = None
        """The last peer judged silent (for the regroup's line)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="torchlaunch-peer-watch", daemon=True)
        self._thread.start()

    def watch(self, peers: tuple[str, ...], cut: Callable[[], object]) -> None:
        """A group formed: its other members' store addresses, and how to cut its connections."""
        with self._lock:
            self._peers, self._cut, self._last = peers, cut, time.monotonic()

    def unwatch(self) -> None:
        """The group is being left (a regroup waits in the quorum for as long as it takes)."""
        with self._lock:
            self._peers, self._cut = (), None

    def stepped(self) -> None:
        self._last = time.monotonic()

    def check(self) -> str | None:
        """One round: the silent peer cut for, or None. What the thread runs every tenth of the bound."""
        with self._lock:
            peers, cut, last = self._peers, self._cut, self._last
        if not peers or cut is None or time.monotonic() - last < self.bound_s / 4:
            return None
        silent = next((p for p in peers if not self._probe(p, self.bound_s)), None)
        if silent is None:
            return None
        with self._lock:
            if self._cut is not cut:  # the group changed meanwhile
                return None
            self._peers, self._cut = (), None
        self.judged = silent
        print(
            f"live: the member at {silent} gave no answer within {self.bound_s:g} s while this rank waited "
            f"{time.monotonic() - last:.1f} s: taken for silent (frozen or cut off); the group is left so "
            "that the others regroup without it",
            file=sys.stderr,
            flush=True,
        )
        cut()
        return silent

    def _run(self) -> None:
        while not self._stop.wait(self.bound_s / 10):
            try:
                self.check()
            except Exception:  # a watcher must never take the rank down
                continue

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.bound_s + 1.0)
