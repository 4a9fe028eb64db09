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
import subprocess
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.jobs.proof import digest

QUERY_TIMEOUT_S = 20


def slurm_comment(run_dir: str | os.PathLike[str]) -> str:
    """The job comment that binds a Slurm job to `run_dir`."""
    return f"torchlaunch:run={digest(str(Path(run_dir).resolve()))[:32]}"


def claim_slurm_job(job_id: str, run_dir: str | os.PathLike[str]) -> None:
    """From inside the job: set its comment to slurm_comment(run_dir), best effort (a job whose output
    is under the run dir is proven without it; a user's own --comment is kept)."""
    try:
        seen = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-O", "Comment:4096"], capture_output=True, text=True, timeout=10
        )
        if seen.returncode != 0 or seen.stdout.strip() not in ("", "(null)"):
            return
        subprocess.run(
            ["scontrol", "update", f"JobId={job_id}", f"Comment={slurm_comment(run_dir)}"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        pass


def slurm_job(job_id: str, run_dir: str | os.PathLike[str]) -> str | None:
    """None when Slurm says job `job_id` names `run_dir` (its output inside it, or its comment), else why not."""
    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-O", "StdOut:4096,Comment:4096"],
            capture_output=True,
            text=True,
            timeout=QUERY_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"squeue cannot say whose job it is ({e})"
    out = done.stdout.strip().splitlines()
    if done.returncode != 0 or not out:
        return "squeue does not know the job (ended, or not this cluster's)"
    line = out[0]
    return proven(job_id, line[:4096].strip(), line[4096:].strip(), run_dir)


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
