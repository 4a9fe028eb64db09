"""bench.slow_node: the live tests' slow survivor. It must really hold the processes it names, and never
leave one stopped, whatever ends it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.slow_node import SlowNode


def state(pid: int) -> str:
    """The process's scheduler state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_named_process_is_stopped_in_turns_and_running_after(sleeper: subprocess.Popen) -> None:
    seen = set()
    with SlowNode(lambda: [sleeper.pid], share=0.2) as slowed:
        deadline = time.monotonic() + 30
        while "T" not in seen and time.monotonic() < deadline:
            seen.add(state(sleeper.pid))
    assert "T" in seen, "never seen stopped"
    assert slowed.turns > 0
    assert state(sleeper.pid) != "T", "left stopped"


def test_until_ends_the_slowing_with_the_process_running(sleeper: subprocess.Popen) -> None:
    done = []
    with SlowNode(lambda: [sleeper.pid], share=0.1, until=lambda: len(done) > 0) as slowed:
        while slowed.turns < 3:
            time.sleep(0.01)  # polling a counter the holding thread moves
        done.append(True)
        slowed._thread.join(timeout=30)
        assert not slowed._thread.is_alive(), "until() did not end it"
        assert state(sleeper.pid) != "T"


def test_a_process_gone_is_no_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with SlowNode(lambda: [proc.pid], share=0.5) as slowed:
        time.sleep(0.2)  # a few turns over a pid that no longer exists
    assert slowed.turns == 0


def test_a_share_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="share"):
        SlowNode(lambda: [], share=0.0)
