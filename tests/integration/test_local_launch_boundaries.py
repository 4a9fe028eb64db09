"""launch.local's boundaries (engineer F's wiring tests, local part): a NUL in a program argument is one
line, one live launch owns a run dir, and the ranks die with a SIGKILLed launcher. The Slurm and
Kubernetes parts of the same wiring are engineer H's."""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, launcher_argv, run_cmd
from torchlaunch.exit_codes import BAD_INPUT


def call(main, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


HOLDER = "import sys; from torchlaunch import runlock; runlock.acquire(sys.argv[1]); print('held', flush=True); sys.stdin.readline()"


@contextlib.contextmanager
def held(run_dir: Path) -> Iterator[int]:
    """Another process holds run_dir's lock (torchlaunch.runlock) while the block runs; its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.communicate("\n")


def test_second_local_launch_on_a_run_dir_is_refused_before_writing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with held(run_dir) as holder:
        argv = launcher_argv(
            "torchlaunch.agent", "--device", "cpu", "--config", "configs/smoke.yaml", f"run_dir={run_dir}"
        )
        code, _, err = run_cmd(argv, timeout=300)
    assert code == BAD_INPUT, err
    assert f"is in use by pid {holder}" in err
    assert not (run_dir / "config.yaml").exists()


PROGRAM = textwrap.dedent(
    """
    import os, time
    print("rank-pid", os.getpid(), flush=True)
    time.sleep(3600)
    """
)


@pytest.mark.slow
def test_sigkilled_local_launcher_leaves_no_rank_running(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    launcher = subprocess.Popen(
        launcher_argv("torchlaunch.agent", "--gpus", "2", "--device", "cpu", "--", str(script)),
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    ranks = []
    while len(ranks) < 2:
        line = launcher.stdout.readline()
        assert line, "the launcher ended before its ranks started"
        if line.startswith("rank-pid "):
            ranks.append(int(line.split()[1]))
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    for pid in ranks:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            assert select.select([fd], [], [], 60)[0], f"rank {pid} still running after the launcher was killed"
        finally:
            os.close(fd)


def test_a_programs_run_dir_is_owned_too(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = tmp_path / "s.py"
    script.write_text("")
    with held(run_dir) as holder:
        argv = launcher_argv("torchlaunch.agent", "--device", "cpu", "--run-dir", str(run_dir), "--", str(script))
        code, _, err = run_cmd(argv, timeout=120)
    assert code == BAD_INPUT, err
    assert len(err.strip().splitlines()) == 1 and f"is in use by pid {holder}" in err
