"""One live job owns a run dir: a second launch is refused naming the holder, a stale lock is taken over
with one warning, and of processes racing for one run dir exactly one wins (real processes)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO as ROOT
from torchlaunch import runlock
from torchlaunch.exit_codes import BadInput

CONTENDER = textwrap.dedent(
    """
    import sys
    from torchlaunch import runlock
    from torchlaunch.exit_codes import BadInput
    sys.stdin.readline()  # the start gate: every contender is up before any tries
    try:
        lock = runlock.acquire(sys.argv[1], command=["contender"])
    except BadInput as error:
        print("lost", str(error), flush=True)
        sys.exit(3)
    print("won", flush=True)
    sys.stdin.readline()  # hold the lock until the test lets go
    """
)

HOLDER = textwrap.dedent(
    """
    import sys
    from torchlaunch import runlock
    runlock.acquire(sys.argv[1], command=["holder"])
    print("holding", flush=True)
    sys.stdin.readline()
    """
)


def python(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def dead_pid() -> int:
    """A pid that was just alive and now is not (it waited for its exit)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(run_dir: Path, **fields) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": runlock.socket.gethostname(), "pid": dead_pid(), "started": 1.0, "command": ["old"], "token": "t"}
    record.update(fields)
    path = run_dir / runlock.LOCK_NAME
    path.write_text(json.dumps(record))
    return path


def refusal(run_dir: Path, **kwargs) -> str:
    with pytest.raises(BadInput) as caught:
        runlock.acquire(run_dir, **kwargs)
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    return message


def test_second_launch_is_refused_naming_the_holder(tmp_path):
    holder = python(HOLDER, str(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "holding"
        message = refusal(tmp_path)
        assert message.startswith(f"launch error: run dir {tmp_path} is in use by pid {holder.pid} on ")
        assert "'holder'" in message and "pass another run dir" in message
    finally:
        holder.communicate("\n")
    assert holder.returncode == 0
    assert not (tmp_path / runlock.LOCK_NAME).exists()  # released at its exit
    runlock.acquire(tmp_path).release()


def test_lock_of_a_sigkilled_holder_is_taken_over_with_one_warning(tmp_path):
    holder = python(HOLDER, str(tmp_path))
    assert holder.stdout.readline().strip() == "holding"
    holder.send_signal(signal.SIGKILL)
    holder.communicate()
    assert (tmp_path / runlock.LOCK_NAME).exists()  # SIGKILL runs no cleanup
    warn = io.StringIO()
    lock = runlock.acquire(tmp_path, warn=warn)
    assert warn.getvalue().count("\n") == 1
    assert f"taking over run dir {tmp_path} from pid {holder.pid}" in warn.getvalue()
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_reused_pid_is_stale(tmp_path):
    """The record's pid is alive (it is ours) but started at another time: another process."""
    plant(tmp_path, pid=os.getpid(), pid_start=runlock.pid_start_time(os.getpid()) + 1)
    warn = io.StringIO()
    runlock.acquire(tmp_path, warn=warn).release()
    assert "holder is gone" in warn.getvalue()


def test_other_boot_is_stale(tmp_path):
    plant(tmp_path, pid=os.getpid(), boot="another-boot")
    warn = io.StringIO()
    runlock.acquire(tmp_path, warn=warn).release()
    assert "taking over" in warn.getvalue()


def test_live_pid_with_its_start_time_is_live(tmp_path):
    plant(tmp_path, pid=os.getppid(), pid_start=runlock.pid_start_time(os.getppid()))
    assert f"in use by pid {os.getppid()}" in refusal(tmp_path)


def test_holder_on_another_host_counts_as_live_and_the_fix_is_named(tmp_path):
    path = plant(tmp_path, host="node-17")
    message = refusal(tmp_path)
    assert "on node-17" in message and f"remove {path}" in message


def test_scheduler_job_liveness_comes_from_the_callable(tmp_path):
    plant(tmp_path, scheduler="slurm", job_id="4242", host="login1")
    asked = []

    def alive(scheduler: str, job_id: str) -> bool:
        asked.append((scheduler, job_id))
        return True

    assert "in use by slurm job 4242 on login1" in refusal(tmp_path, job_alive=alive)
    assert asked == [("slurm", "4242")]
    assert "slurm job 4242" in refusal(tmp_path)  # no callable: cannot tell, so live
    warn = io.StringIO()
    runlock.acquire(tmp_path, job_alive=lambda s, j: False, warn=warn).release()
    assert "taking over" in warn.getvalue() and "slurm job 4242" in warn.getvalue()


def test_own_scheduler_job_takes_its_lock_back_silently(tmp_path):
    plant(tmp_path, scheduler="k8s", job_id="default/run", host="run-0-abcde")
    warn = io.StringIO()
    lock = runlock.acquire(tmp_path, scheduler="k8s", job_id="default/run", warn=warn)
    assert warn.getvalue() == ""
    assert json.loads(lock.path.read_text())["host"] == runlock.socket.gethostname()
    lock.release()


def test_release_never_removes_a_later_owners_lock(tmp_path):
    lock = runlock.acquire(tmp_path)
    path = plant(tmp_path, token="someone-else")
    lock.release()
    assert path.exists()


def test_a_held_flock_means_live_whatever_the_record(tmp_path):
    """A record naming a dead pid, but a live process still holds the lock file's flock."""
    path = plant(tmp_path)
    keeper = python(
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); sys.stdin.readline()",
        str(path),
    )
    try:
        assert keeper.stdout.readline().strip() == "locked"
        assert "is in use by" in refusal(tmp_path)
    finally:
        keeper.communicate("\n")


def race(run_dir: Path, contenders: int) -> tuple[list[str], list[subprocess.Popen[str]]]:
    procs = [python(CONTENDER, str(run_dir)) for _ in range(contenders)]
    for proc in procs:
        proc.stdin.write("\n")
        proc.stdin.flush()
    results = [proc.stdout.readline().strip().split(" ", 1)[0] for proc in procs]
    return results, procs


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_racing_processes_exactly_one_wins(tmp_path, stale):
    for round_ in range(4):
        run_dir = tmp_path / f"run{round_}"
        if stale:
            plant(run_dir)
        results, procs = race(run_dir, 3)
        try:
            assert sorted(results) == ["lost", "lost", "won"], results
            winner = procs[results.index("won")]
            assert json.loads((run_dir / runlock.LOCK_NAME).read_text())["pid"] == winner.pid
        finally:
            for proc in procs:
                proc.communicate("\n")
        assert sorted(p.returncode for p in procs) == [0, 3, 3]
        assert not (run_dir / runlock.LOCK_NAME).exists()
