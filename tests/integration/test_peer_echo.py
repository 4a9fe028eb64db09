"""A rank's echo to its peers' probes (live/peers.py, echo_process.py), delivered from
outside: the rank is a process of its own, its GIL held by a C call, stopped, sent a job's SIGTERM,
killed. The echo must answer exactly while the rank runs, whatever holds the rank's GIL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.conftest import REPO, child_env
from tests.integration.test_pdeath import gone_within  # a pidfd: the process's end itself
from torchlaunch.live.peers import answers

BOUND_S = 10.0
"""Every wait here is bounded by this; none is a sleep standing in for synchronisation."""

HOLD_S = 4.0
"""How long the rank's main thread keeps its GIL in one C call: longer than a probe's bound (1 s)."""

RANK = f"""
import ctypes, signal, sys
from torchlaunch.live.peers import Echo
signal.signal(signal.SIGTERM, lambda *_: print("term", flush=True))  # a rank saving after a stop
echo = Echo()
print(echo.port, echo.process.pid, flush=True)
for line in sys.stdin:
    if line.strip() == "hold":
        print("holding", flush=True)
        ctypes.PyDLL(None).usleep({int(HOLD_S * 1e6)})  # PyDLL keeps the GIL for the whole call
        print("released", flush=True)
echo.close()
print("closed", flush=True)
"""


@contextmanager
def rank() -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK],
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        port, echo_pid = proc.stdout.readline().split()
        yield proc, f"127.0.0.1:{port}", int(echo_pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=BOUND_S)


def test_the_echo_answers_while_the_rank_holds_its_gil_and_not_while_it_is_stopped() -> None:
    with rank() as (proc, address, _):
        assert proc.stdin is not None and proc.stdout is not None
        assert answers(address, 1.0)
        proc.stdin.write("hold\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "holding"
        started = time.monotonic()
        assert answers(address, 1.0), "a rank whose GIL a C call holds was taken for silent"
        assert time.monotonic() - started < HOLD_S  # asked inside the hold, not after it
        assert proc.stdout.readline().strip() == "released"
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert not answers(address, 1.0), "a stopped rank's echo answered for it"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert answers(address, 1.0)


def test_a_jobs_sigterm_leaves_the_echo_to_the_rank_and_the_ranks_end_ends_it() -> None:
    """Slurm and Docker signal every process of the job: the rank saves after a SIGTERM, and its peers
    must not take it for silent meanwhile. SIGKILL of the rank alone ends the echo too."""
    with rank() as (proc, address, echo_pid):
        assert proc.stdout is not None
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.stdout.readline().strip() == "term"
        assert answers(address, 1.0), "the echo died of the job's SIGTERM while its rank lived"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=BOUND_S)
        assert gone_within(echo_pid, bound_s=BOUND_S), "the echo outlived its rank"
        assert not answers(address, 0.5)


def test_closing_the_echo_ends_its_process() -> None:
    with rank() as (proc, address, echo_pid):
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        assert proc.stdout.readline().strip() == "closed"
        assert gone_within(echo_pid, bound_s=BOUND_S)
        assert not answers(address, 0.5)
