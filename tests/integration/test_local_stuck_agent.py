"""After the hang watchdog ended the ranks, torchrun's agent gets a bounded grace, then is ended.

An agent cut off from the rendezvous store on node 0 blocks in a store read and never notices that
its workers were killed (the faults suite's cut link, tests/engines/faults); these fake agents stand for it
(a process ignoring SIGTERM), for one that exits on its own, and for one that restarts its workers.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from torchlaunch import pdeath
from torchlaunch.agent import ranks, watch
from torchlaunch.exit_codes import FAILURE

STUCK = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)\n"
# A fake agent with one child (a worker) that also outlives SIGTERM; it prints the child's pid.
WITH_CHILD = textwrap.dedent(
    f"""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", {STUCK!r}], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(300)
    """
)


def start(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.fixture
def cleanup():
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        pdeath.kill_tree(proc.pid)
        proc.wait(timeout=10)


def test_a_stuck_agent_is_ended_after_the_grace_with_one_line(cleanup):
    agent = start(WITH_CHILD)
    cleanup.append(agent)
    worker = int(agent.stdout.readline())
    err = io.StringIO()
    began = time.monotonic()
    # The child counts as the killed rank: a rank that is not gone yet is no restart.
    assert watch.end_stuck_agent(agent, [worker], grace_s=0.5, err=err) is True
    assert 0.5 <= time.monotonic() - began < 5
    assert agent.wait(timeout=10) == -9
    deadline = time.monotonic() + 10
    while alive(worker):  # killed with the agent, although in a session of its own
        assert time.monotonic() < deadline, f"worker {worker} outlived its agent"
        time.sleep(0.05)
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "ended it (exit 1, retryable)" in lines[0], lines


def test_an_agent_that_exits_in_the_grace_is_left_alone(cleanup):
    agent = start("import time; time.sleep(0.3)")
    cleanup.append(agent)
    err = io.StringIO()
    assert watch.end_stuck_agent(agent, [], grace_s=30, err=err) is False
    assert agent.wait(timeout=10) == 0 and err.getvalue() == ""


def test_an_agent_that_restarted_its_workers_is_left_alone(cleanup):
    agent = start(WITH_CHILD)
    cleanup.append(agent)
    worker = int(agent.stdout.readline())
    err = io.StringIO()
    began = time.monotonic()
    assert watch.end_stuck_agent(agent, [], grace_s=30, err=err) is False  # `worker` is a new one
    assert time.monotonic() - began < 5 and agent.poll() is None and alive(worker)
    assert err.getvalue() == ""
    assert watch.restarted_workers(agent.pid, []) == [worker]
    assert watch.restarted_workers(agent.pid, [worker]) == []


class HangingOp:
    """An Operation whose watchdog finds a hang at once (from its own thread, as the real one)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def start(self, on_hang) -> None:
        self.thread = threading.Thread(target=on_hang, args=(None, Path("."), []), daemon=True)
        self.thread.start()

    def finish(self, code: int, reason: str = "") -> int:
        return code


def test_run_ends_a_stuck_agent_after_a_hang_and_exits_1(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(watch, "AGENT_GRACE_S", 0.5)
    began = time.monotonic()
    code = ranks.run([sys.executable, "-c", STUCK], dict(os.environ), tmp_path, "a1", op=HangingOp(), agent=True)
    assert code == FAILURE and time.monotonic() - began < 30
    err = capfd.readouterr().err
    assert "neither exited nor restarted the ranks" in err and "torchrun exit -9" in err, err
