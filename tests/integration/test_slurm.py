"""test_slurm: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_slurm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_slurm import run_cli
from torchlaunch.exit_codes import BAD_INPUT


def test_cli_dry_run_prints_the_script_and_submits_nothing(tmp_path: Path) -> None:
    result = run_cli(
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--time",
        "240",
        "--config",
        "configs/cifar10.yaml",
        "--dry-run",
        f"run_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --gpus-per-node=8" in result.stdout and "#SBATCH --requeue" in result.stdout
    assert "#SBATCH --signal=USR2@90" in result.stdout
    assert not (tmp_path / "slurm").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "--nodes must be >= 1"),
        (["--gpus-per-node", "0"], "must be >= 1"),
        (["--time", "1", "--signal-delay-s", "90"], "--signal-delay-s"),
        (["--max-timeouts", "-1"], "--max-timeouts"),
        (["--sbatch", "=x"], "KEY=VALUE"),
    ],
)
def test_bad_arguments_one_line_exit_2(args: list[str], message: str) -> None:
    result = run_cli("--config", "configs/smoke.yaml", "--dry-run", *args)
    assert result.returncode == BAD_INPUT
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_doctor_runs_the_preflight_in_each_task() -> None:
    from torchlaunch.backends.slurm.launch import parse_args
    from torchlaunch.backends.slurm.render import task_argv

    spec, options, _ = parse_args(
        ["--nodes", "2", "--tasks-per-node", "2", "--doctor", "--config", "configs/smoke.yaml"]
    )
    assert task_argv(spec, options, "/r")[:3] == ["-m", "torchlaunch.tools.preflight", "--config"]
    spec, options, _ = parse_args(["--nodes", "2", "--tasks-per-node", "2", "--config", "configs/smoke.yaml"])
    assert task_argv(spec, options, "/r")[:3] == ["-m", "torchlaunch.worker", "--config"]  # through the runner
