"""test_slurm_cli: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

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


ALLOCATION_START = """
import sys
from torchlaunch.backends.slurm.task import SlurmTask

task = SlurmTask(argv=["-m", "torchlaunch.worker"], time_min=60, signal_delay_s=90, run_dir=sys.argv[1], hang_timeout=0)
task._operation(local_rank=0, local_world_size=2)
"""


def test_the_next_allocation_says_what_a_killed_one_lost_before_it_records_itself(tmp_path: Path) -> None:
    """Issue #53 (honest codes): a run dir as an allocation SIGKILLed mid-save leaves it (no outcome,
    beats at step 9, checkpoint of step 4), with rank 1 of the next allocation started first (its first
    heartbeat replaced its beat, as on the dev cluster); rank 0's task start (a real process, with the
    env srun and submitit give it) says the loss in one line before its own first heartbeat replaces
    its beat, then records itself. No Slurm tool is reachable (PATH): the job's claim is best effort."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.unit.test_slurm import _killed_allocation
    from torchlaunch.jobs import record

    _killed_allocation(tmp_path, "999999977-0", "999999977", trained=9, checkpoint=4)
    started = {"rank": 1, "launch": "999999977-1", "step": None}  # rank 1's first beat of this allocation
    (tmp_path / "progress" / "rank-1.json").write_text(json.dumps(started))
    slurm = {"SLURM_JOB_ID": "999999977", "SLURM_RESTART_COUNT": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "1"}
    slurm |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    env = {**os.environ, **slurm, "PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATION_START, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if "step(s) trained" in line]
    assert said == [
        "slurm task: allocation 999999977-0 of job 999999977 ended without a word (killed: its grace, time limit or "
        "node ran out) before its checkpoint committed: at least 5 step(s) trained since the checkpoint of step 4 "
        "are lost (exit 1); this allocation resumes from there"
    ], done.stdout
    (node0,), _ = record.read_all(tmp_path)
    assert (node0.launch_id, node0.outcome) == ("999999977-1", None)
