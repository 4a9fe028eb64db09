"""Proof that a Slurm job is this run's, before `cancel` scancels it (torchlaunch.jobs.proof says why a
record is only a claim): the job names this run dir itself, in what only its owner can set. Its standard
output (squeue's StdOut, which launch.slurm puts under RUN_DIR/slurm/) lies inside the run dir, or its
comment is `torchlaunch:run=<digest of the run dir's real path>`, which a launcher running inside a job
(a user's own sbatch script) sets at start. A forged record in run dir X naming a job of run dir V fails
both: the job's output and comment name V.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
    stdout, comment = line[:4096].strip(), line[4096:].strip()
    if comment == slurm_comment(run_dir):
        return None
    root = Path(run_dir).resolve()
    try:
        inside = Path(stdout).resolve().is_relative_to(root)
    except (OSError, ValueError):
        inside = False
    return None if inside else f"its output goes to {stdout[:200]}, not under {root} (the record is not this run's)"
