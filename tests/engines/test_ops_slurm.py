"""`python -m launch status` and `cancel` against a real Slurm job (slurm/dev-cluster.sh): squeue then
sacct give the state, cancel marks the run and scancels, the task checkpoints on SIGTERM and records
`cancelled`, and Slurm does not requeue it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv
from torchlaunch.jobs import record

pytestmark = pytest.mark.slurm

DEV_CLUSTER = REPO / "slurm" / "dev-cluster.sh"

TASK = """\
import os, signal, sys
from torchlaunch.jobs import record
from torchlaunch.backends.slurm import proof as slurm_proof
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
run = sys.argv[1]
slurm_proof.claim_slurm_job(os.environ["SLURM_JOB_ID"], run)  # before the record, as jobs.launcher.Operation.start
rec = record.start(run, scheduler="slurm", command=sys.argv, job_id=os.environ["SLURM_JOB_ID"], launch_id="SL1")
signal.sigwait({signal.SIGTERM})
outcome = "cancelled" if record.cancel_requested(run, rec.launch_id) else "preempted"
record.finish(run, rec, 75, outcome, "checkpoint committed on SIGTERM")
"""


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    if subprocess.run(["bash", str(DEV_CLUSTER), "status"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("the Slurm dev cluster is not up (slurm/dev-cluster.sh up)")
    out = subprocess.run(["bash", str(DEV_CLUSTER), "env"], capture_output=True, text=True, timeout=60).stdout
    conf = out.strip().split("SLURM_CONF=", 1)[1].split()[0]
    return {**os.environ, "SLURM_CONF": conf, "PYTHONPATH": str(REPO)}


def launch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        launcher_argv("launch", *args), cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def wait_for_state(run: Path, wanted: str, env: dict[str, str], timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    data: dict = {}
    while time.monotonic() < deadline:
        done = launch("status", str(run), "--json", env=env)
        data = json.loads(done.stdout) if done.returncode == 0 else {}
        if data.get("state") == wanted:
            return data
        time.sleep(0.5)  # polling the scheduler under a deadline
    raise AssertionError(f"state never became {wanted}: last {data}")


def test_status_and_cancel_of_a_real_slurm_job(slurm_env: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "task.py"
    script.write_text(TASK)
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--requeue",
            "-o",
            str(tmp_path / "slurm-%j.out"),
            "--wrap",
            f"exec {sys.executable} {script} {run}",
        ],
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 120
        while not record.read_all(run)[0] and time.monotonic() < deadline:
            time.sleep(0.2)  # polling for the task's record under a deadline
        data = wait_for_state(run, "running", slurm_env)
        assert (data["scheduler"], data["job_id"]) == ("slurm", job_id)
        done = launch("cancel", str(run), env=slurm_env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"scancel {job_id}" in done.stdout
        data = wait_for_state(run, "cancelled", slurm_env)
        deadline = time.monotonic() + 120
        while record.read_all(run)[0][0].outcome is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert record.read_all(run)[0][0].outcome == "cancelled"
        sacct = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
            env=slurm_env,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert sacct.strip().splitlines()[-1].startswith("CANCELLED") and "REQUEUED" not in sacct
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env, capture_output=True, timeout=30)
