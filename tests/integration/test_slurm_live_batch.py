"""The live sbatch's `srun` (backends.slurm.live.batch_lines) run by bash with a fake srun on PATH: the
batch script's code, which Slurm makes the job's, is the survivors' outcome read from the tasks'
records, not srun's 137 for a lost task."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.unit.test_slurm_live import LIVE, spec, write_record
from torchlaunch import contract
from torchlaunch.backends.slurm.render import executor_parameters
from torchlaunch.exit_codes import FAILURE, OK


def batch_srun(
    tmp_path: Path, run_dir: Path, srun_code: int, allocated: str = "2", **changes: object
) -> subprocess.CompletedProcess:
    """The live sbatch's setup lines and a `srun` call, run by bash with a fake srun exiting `srun_code`,
    in an allocation of `allocated` nodes (SLURM_NNODES, as sbatch sets it)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "srun").write_text(f"#!/bin/sh\nexit {srun_code}\n")
    (fake / "srun").chmod(0o755)
    options = dataclasses.replace(LIVE, python=sys.executable, repo_root=str(REPO))
    setup = executor_parameters(spec(**{"nodes": 2, "gpus_per_node": 1, **changes}), options, str(run_dir))["setup"]
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        contract.SLURM_JOB_ID: "7",
        contract.SLURM_NNODES: allocated,
    }
    env.pop(contract.SLURM_RESTART_COUNT, None)
    script = "\n".join(setup) + "\nsrun --fake step\n"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)


def test_the_batch_script_ends_with_the_survivors_outcome(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_record(run_dir, "7", 0, OK, "7-0")  # task 1 left none: lost
    done = batch_srun(tmp_path, run_dir, 137)
    assert done.returncode == OK, done.stderr
    assert (
        "live: srun exited 137; task(s) 1 lost (no outcome recorded, or left out of the group that trained); the others finished"
        in done.stdout
    )
    write_record(run_dir, "7", 0, FAILURE, "7-0")
    assert batch_srun(tmp_path, run_dir, 137).returncode == FAILURE
    assert batch_srun(tmp_path, tmp_path / "empty", 0).returncode == OK  # srun's 0 needs no verdict


def test_a_node_range_counts_the_tasks_of_the_allocation(tmp_path: Path) -> None:
    """--nodes 2-3 that Slurm started on 2 nodes: 2 tasks, not 3 (a third with no record would be 'lost')."""
    run_dir = tmp_path / "run"
    write_record(run_dir, "7", 0, OK, "7-0")
    write_record(run_dir, "7", 1, OK, "7-0")
    done = batch_srun(tmp_path, run_dir, 1, "2", nodes=3, min_nodes=2)
    assert done.returncode == OK, done.stderr
    assert "lost" not in done.stdout


def test_the_verdict_still_reads_a_fixed_task_count(tmp_path: Path) -> None:
    """A job submitted before the count was taken at run time calls the verdict with --tasks N (Slurm
    keeps the batch script across a requeue); it is judged the same."""
    run_dir = tmp_path / "run"
    write_record(run_dir, "7", 0, OK, "7-0")
    env = {**os.environ, contract.SLURM_JOB_ID: "7"}
    env.pop(contract.SLURM_RESTART_COUNT, None)
    argv = ["-m", "torchlaunch.backends.slurm.live", "--run-dir", str(run_dir), "--tasks", "2", "--srun-code", "137"]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == OK, done.stderr
    assert (
        "task(s) 1 lost (no outcome recorded, or left out of the group that trained); the others finished"
        in done.stdout
    )
