"""Proof that a Slurm job is this run's, before `cancel` or the successor chain scancels it
(torchlaunch.jobs.proof says why a record is only a claim): the job names this run dir itself, in what
only its owner can set. Its standard output (squeue's StdOut) is in the folder launch.slurm gives each
job, RUN_DIR/slurm/JOB/ (JOB its own id, or the `%j` pattern squeue may print unexpanded), or its
comment is `torchlaunch:run=<digest of the run dir's real path>`, which a launcher running inside a job
(a user's own sbatch script) sets at start. A forged record in run dir X naming a job of run dir V fails
both: the job's output and comment name V. Output merely somewhere below the run dir proves nothing: a
record forged in a parent folder of V (or of any job's output) would otherwise "prove" V's jobs.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.backends.slurm import cluster
from torchlaunch.jobs.proof import digest

CLAIM_TIMEOUT_S = 10.0
"""The claim runs as the job starts: a controller that does not answer delays it by at most this, twice."""


def slurm_comment(run_dir: str | os.PathLike[str]) -> str:
    """The job comment that binds a Slurm job to `run_dir`."""
    return f"torchlaunch:run={digest(str(Path(run_dir).resolve()))[:32]}"


def claim_slurm_job(job_id: str, run_dir: str | os.PathLike[str]) -> None:
    """From inside the job: set its comment to slurm_comment(run_dir), best effort (a job whose output
    is under the run dir is proven without it; a user's own --comment is kept)."""
    seen = cluster.owner_fields(job_id, CLAIM_TIMEOUT_S)
    if seen is None or seen[1] not in ("", "(null)"):
        return
    cluster.set_comment(job_id, slurm_comment(run_dir), CLAIM_TIMEOUT_S)


def slurm_job(job_id: str, run_dir: str | os.PathLike[str]) -> str | None:
    """None when Slurm says job `job_id` names `run_dir` (its output inside it, or its comment), else why not."""
    seen = cluster.owner_fields(job_id)
    if seen is None:
        return "squeue cannot say whose job it is (no answer, or the job ended or is not this cluster's)"
    return proven(job_id, *seen, run_dir)


JOB_FOLDER_PATTERNS = ("%j", "%A")
"""The job folder's name as squeue may print it, the sbatch --output pattern unexpanded (Slurm 22.05)."""


def proven(job_id: str, stdout: str, comment: str, run_dir: str | os.PathLike[str]) -> str | None:
    """None when a job with this output path and comment is `run_dir`'s, else why not (pure but for
    resolving paths): its comment binds it, or its output file lies in RUN_DIR/slurm/JOB/ itself."""
    if comment == slurm_comment(run_dir):
        return None
    root = Path(run_dir).resolve()
    base = job_id.split("_")[0]
    try:
        folder = Path(stdout).resolve().parent
        here = folder.parent == rundir.slurm(root).resolve() and folder.name in (job_id, base, *JOB_FOLDER_PATTERNS)
    except (OSError, ValueError, RuntimeError):
        here = False
    if here and stdout:
        return None
    return f"its output goes to {stdout[:200]}, not to {rundir.slurm(root)}/{job_id}/ (the record is not this run's)"
