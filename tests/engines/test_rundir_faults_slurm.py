"""test_rundir_faults_slurm: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/integration/test_rundir_faults_os.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from torchlaunch import rundir
from torchlaunch.backends.slurm import proof as slurm_proof
from torchlaunch.backends.slurm import successor as slurm_successor
from torchlaunch.jobs import cli, record


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_forged_slurm_job_id_of_another_job_is_not_scancelled(tmp_path: Path, capsys) -> None:
    from tests.engines.test_slurm_cluster import slurm
    from tests.engines.test_slurm_ops_cluster import cluster  # noqa: F401 - the fixture's skip rule

    dev = REPO / "slurm" / "dev-cluster.sh"
    if subprocess.run(["bash", str(dev), "status"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("the Slurm dev cluster is not up (slurm/dev-cluster.sh up)")
    env_out = subprocess.run(["bash", str(dev), "env"], capture_output=True, text=True, timeout=60).stdout
    os.environ["SLURM_CONF"] = env_out.split("SLURM_CONF=", 1)[1].split()[0]
    other = tmp_path / "other"
    other.mkdir()
    job = slurm("sbatch", "--parsable", "-o", f"{other}/out-%j.txt", "--wrap", "sleep 300").strip().split(";")[0]
    try:
        run = tmp_path / "run"
        forged = record.JobRecord(launch_id="S9", scheduler="slurm", job_id=job, host="node1", started=time.time())
        rundir.write_json(record.record_path(run), forged.to_json())
        capsys.readouterr()
        assert cli.main(["cancel", str(run)], out=io.StringIO()) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"Slurm job {job} is not proven this run's" in err[0]
        assert slurm("squeue", "-h", "-j", job, "-o", "%T").strip() in ("PENDING", "RUNNING", "CONFIGURING")
        # Output merely below a folder proves nothing (issue 52): a record forged there names foreign jobs.
        assert "not to" in (slurm_proof.slurm_job(job, other) or "")
        # The chain's end step: a forged chain.json naming the foreign job as a successor scancels nothing.
        slurm_successor.write(run, slurm_successor.Chain("1", successor=job, launch="1-0"))
        env = {"SLURM_JOB_ID": "1", "SLURM_CONF": os.environ["SLURM_CONF"], "PATH": os.environ["PATH"]}
        assert slurm_successor.end(str(run), 0, env) == 0
        assert f"job {job} left alone" in capsys.readouterr().out
        assert slurm("squeue", "-h", "-j", job, "-o", "%T").strip() in ("PENDING", "RUNNING", "CONFIGURING")
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
