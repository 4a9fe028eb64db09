"""test_local_launcher_cli: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_local_launcher.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from tests.conftest import error_lines, launcher_argv, run_launcher, run_module
from tests.unit.test_local_launcher import SMOKE
from tests.unit.test_user_programs import torchrun_tail
from torchlaunch.exit_codes import FAILURE, OK


def test_dry_run_prints_the_command_and_starts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rc, out, err = run_launcher(
        ["--gpus", "2", "--device", "cpu", "--config", SMOKE, "--dry-run", f"run_dir={run_dir}", "optim.lr=0.01"],
        timeout=60,
    )
    assert rc == 0, err
    assert len(out.splitlines()) == 1
    # the recipe and overrides as typed: the command runs as printed (tests/unit/test_newcomer2.py)
    program = ("-m", "torchlaunch.worker", "--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.01")
    argv = shlex.split(out)  # two ranks: the live road by default (recovery.live=auto), its agent's command
    assert argv[1:5] == ["-m", "torchlaunch.agent.live", "--nproc", "2"], argv
    assert argv[argv.index("--") + 1 :] == ["-m", "torchlaunch.runner", *program]
    assert not run_dir.exists()
    rc, out, err = run_launcher(  # the way out: torchrun's command
        ["--gpus", "2", "--device", "cpu", "--config", SMOKE, "--dry-run", f"run_dir={run_dir}", "recovery.live=false"],
        timeout=60,
    )
    restart = ("-m", "torchlaunch.worker", "--config", SMOKE, f"run_dir={run_dir}", "recovery.live=false")
    assert rc == 0 and shlex.split(out) == launcher_argv(
        "torchlaunch.launch.torchrun", "--nnodes", "1", *torchrun_tail("2", "0", *restart)
    )


def test_dry_run_still_validates_the_config(tmp_path: Path) -> None:
    rc, out, err = run_launcher(
        ["--gpus", "1", "--config", SMOKE, "--dry-run", f"run_dir={tmp_path}", "optim.lr=-1"], timeout=60
    )
    assert rc == 2 and out == ""
    assert error_lines(err) == [
        "config error: optim.lr: must be > 0, got -1.0 (use a positive learning rate such as optim.lr=0.1)"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here: --device cuda is valid")
def test_device_cuda_without_gpu(tmp_path: Path) -> None:
    rc, out, err = run_launcher(
        ["--gpus", "1", "--device", "cuda", "--config", SMOKE, f"run_dir={tmp_path}"], timeout=60
    )
    assert rc == 2 and out == ""
    lines = error_lines(err)
    assert len(lines) == 1 and "--device cuda but no GPU is visible" in lines[0], err
    assert not (tmp_path / "config.yaml").exists()  # refused before anything was started


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("program", "code"), [("true", OK), ("false", FAILURE)])
def test_launch_torchrun_keeps_torchruns_exit_code_and_report(program: str, code: int) -> None:
    """launch.torchrun skips only the interpreter teardown: exit code and failure report are torchrun's."""
    rc, out, err = run_module(
        "torchlaunch.launch.torchrun", ["--standalone", "--nproc-per-node", "1", "--no-python", program], timeout=100
    )
    assert rc == code, err
    assert ("Traceback (most recent call last)" in err and "ChildFailedError" in err) == (code != OK), err
