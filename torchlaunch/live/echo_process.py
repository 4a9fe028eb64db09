"""A rank's echo in a process of its own: its peers' probes are answered whatever holds the rank's GIL.

Why a process: an echo thread answers only while it holds the rank's GIL, and one long C call that
keeps it (a json or pickle of a big object, a sum over a range, an extension that never releases it)
left a healthy rank unanswered past the bound; its peers took it for frozen and regrouped without it.
The kernel schedules this process on its own. It still answers only for a rank that runs: while its
parent exists and is not stopped (SIGSTOP, a traced stop), so a frozen rank is silent as before, and a
frozen or cut-off node silences it with everything else there. Signals a job's processes get (SIGTERM
from Slurm or Docker, Ctrl-C) are the rank's to act on: the echo ignores them and answers through the
stop's save, ending with its rank (Echo.close, or the rank gone).

Run as `python -I -S echo_process.py FD PID`: the bound UDP socket and the rank's process id. Standard
library only, so it starts in milliseconds and imports nothing of the environment's.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys

IGNORED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU")
"""What a scheduler or a terminal sends every process of a job; the rank decides, the echo lives on."""

NOT_RUNNING = frozenset(b"TtZXx")
"""/proc states of a rank that cannot answer: stopped, traced, dead."""


def rank_runs(pid: int, proc: bool) -> bool:
    """Whether the rank `pid`, this process's parent, exists and is not stopped."""
    if os.getppid() != pid:
        return False
    if not proc:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    after_name = stat[stat.rfind(b")") + 2 :]  # the name may hold spaces and parentheses
    return bool(after_name) and after_name[0] not in NOT_RUNNING


def serve(sock: socket.socket, pid: int) -> None:
    proc = os.path.isdir("/proc/self")
    while True:
        ready, _, _ = select.select([sock], [], [], 0.5)
        if os.getppid() != pid:
            return  # the rank is gone: so is its echo
        if not ready:
            continue
        try:
            data, source = sock.recvfrom(64)
            if rank_runs(pid, proc):  # a stopped rank's probe is dropped unanswered, as the rank is silent
                sock.sendto(data, source)
        except OSError:
            continue


def ignored() -> set[signal.Signals]:
    return {getattr(signal, name) for name in IGNORED if hasattr(signal, name)}


def main(argv: list[str]) -> int:
    """Started with `ignored()` blocked (peers.Echo): ignore them, then let them in (one sent meanwhile
    is dropped, not acted on)."""
    for number in ignored():
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored())
    fd, pid = int(argv[1]), int(argv[2])
    serve(socket.socket(fileno=fd), pid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
