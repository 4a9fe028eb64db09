"""The hang watchdog: its pure decision, and real stack dumps of real (torch-free) child processes
that register faulthandler as the runner does: a blocked rank's stack names the blocking line, a
SIGSTOPped rank is reported as stopped instead of waited for, an unregistered one is never signalled."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch.base import procs
from torchlaunch.jobs import progress, watchdog

HOST = socket.gethostname()

CHILD = """\
import os
from torchlaunch.jobs import progress

registered = os.environ.get("REGISTER") == "1"
if registered:
    progress.register_stack_dump()
if os.environ.get("MASK") == "1":  # registered, but the signal never arrives: a rank that cannot answer
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {progress.DUMP_SIGNAL})
progress.heartbeat(3, total=10)
r, w = os.pipe()


def block_here():
    print("ready", flush=True)
    os.read(r, 1)  # the blocking line


block_here()
"""
BLOCKING_LINE = CHILD.splitlines().index("    os.read(r, 1)  # the blocking line") + 1


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    children: list[subprocess.Popen] = []
    script = tmp_path / "rank.py"
    script.write_text(CHILD)

    def start(rank: int, register: bool = True, mask: bool = False) -> subprocess.Popen:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            progress.PROGRESS_DIR_ENV: str(progress.folder(tmp_path)),
            progress.LAUNCH_ENV: "L1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "REGISTER": "1" if register else "0",
            "MASK": "1" if mask else "0",
        }
        child = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        blocked_in_read(child.pid)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
        child.wait(timeout=30)


def blocked_in_read(pid: int, bound_s: float = 60.0) -> None:
    """Wait until the child sleeps in the kernel (its os.read on the pipe: the only sleep after "ready"):
    on a loaded box "ready" can be read while the child is still on the print line, and a stack dumped
    then names that line, not the blocking one."""
    deadline = time.monotonic() + bound_s
    while procs.state(pid) != "S":
        assert time.monotonic() < deadline, f"pid {pid} never blocked (state {procs.state(pid)!r})"
        os.sched_yield()


def beat_of(run: Path, rank: int) -> progress.RankBeat:
    beats, _ = progress.read_all(progress.folder(run))
    return next(b for b in beats if b.rank == rank)


def test_a_blocked_rank_is_dumped_at_its_blocking_line(tmp_path: Path, spawn) -> None:
    child = spawn(0)
    b = beat_of(tmp_path, 0)
    assert (b.pid, b.step, b.dump_signal) == (child.pid, 3, int(progress.DUMP_SIGNAL))
    verdict = watchdog.Verdict(True, (0,), 700.0, "no rank progressed for 700s")
    err = io.StringIO()
    folder, results = watchdog.dump_stacks(tmp_path, [b], verdict, wait_s=60, err=err)
    assert folder.parent == tmp_path / "hangs" and results[0].how == "faulthandler"
    text = (folder / "rank-0.txt").read_text()
    assert f'rank.py", line {BLOCKING_LINE} in block_here' in text
    assert "stalled ranks 0" in err.getvalue() and "[rank 0]   File" in err.getvalue()
    assert child.poll() is None  # the dump signal does not end the rank


def test_a_stopped_rank_is_named_not_waited_for(tmp_path: Path, spawn) -> None:
    child = spawn(1)
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while procs.state(child.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)  # polling /proc until the kernel shows the stop
    stack = progress.stack_path(progress.folder(tmp_path), 1)
    before = stack.stat().st_size
    result = watchdog.dump_rank(beat_of(tmp_path, 1), progress.folder(tmp_path), wait_s=600)
    assert result.how == "stopped" and "stopped (SIGSTOP" in result.text and f"pid {child.pid}" in result.text
    assert stack.stat().st_size == before  # it was not asked (the request would wait until SIGCONT)


def test_an_unregistered_rank_is_never_signalled(tmp_path: Path, spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy
    child = spawn(2, register=False)
    result = watchdog.dump_rank(beat_of(tmp_path, 2), progress.folder(tmp_path), wait_s=60)
    assert result.how == "unavailable" and child.poll() is None


def test_a_rank_that_does_not_answer_is_reported_at_the_deadline(
    tmp_path: Path, spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy
    silent, answering = spawn(3, mask=True), spawn(4)
    beats = [beat_of(tmp_path, 3), beat_of(tmp_path, 4)]
    results = watchdog.dump_ranks(beats, progress.folder(tmp_path), wait_s=2.0)
    assert [r.how for r in results] == ["no answer", "faulthandler"]
    assert "no stack within 2s" in results[0].text and "in block_here" in results[1].text
    assert silent.poll() is None and answering.poll() is None


def test_the_watchdog_thread_dumps_and_reports_a_hang(tmp_path: Path, spawn) -> None:
    spawn(0)
    spawn(1)
    hung = threading.Event()
    found: dict[str, object] = {}

    def on_hang(verdict: watchdog.Verdict, folder: Path, beats: list[progress.RankBeat]) -> None:
        found.update(verdict=verdict, folder=folder, beats=beats)
        hung.set()

    dog = watchdog.Watchdog(tmp_path, "L1", option_s=1.0, poll_s=0.05)
    dog.start(on_hang)
    try:
        assert hung.wait(120), "the watchdog never reported the hang"
    finally:
        dog.stop()
    folder = found["folder"]
    assert isinstance(folder, Path) and sorted(p.name for p in folder.iterdir()) == [
        "rank-0.txt",
        "rank-1.txt",
        "summary.txt",
    ]
    assert "in block_here" in (folder / "rank-1.txt").read_text()
    assert set(found["verdict"].stalled) == {0, 1}  # type: ignore[union-attr]
    assert sorted(b.rank for b in found["beats"]) == [0, 1]  # type: ignore[union-attr]


def test_a_forked_child_does_not_overwrite_its_ranks_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(progress, "_writer", None)
    progress.heartbeat(7)
    pid = os.fork()
    if pid == 0:  # a data loader worker calling into the same code
        progress._writer.interval_s = 0.0  # type: ignore[union-attr]
        progress.heartbeat(999)
        os._exit(0)
    os.waitpid(pid, 0)
    (only,), _ = progress.read_all(tmp_path)
    assert (only.rank, only.step, only.pid) == (5, 7, os.getpid())
