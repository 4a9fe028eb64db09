"""Proof that a job record's process or job is this run's, before `cancel` signals or scancels it.

A record is a file in the run dir: anyone who can write there can name any pid (with the start time
anyone can read from /proc) or any Slurm job id. So a record is only a claim, and cancel acts on it
only with proof that no forger can make:

- local: the launcher makes a random token per launch, puts it in its children's environment and
  only its SHA-256 in the record. A process is this run's launcher when one of its children holds a
  token with the recorded digest in /proc/PID/environ, which only the process's owner (or root) can
  read: an unrelated process has no such child, and another user's launcher's token cannot be read.
- Slurm: the job names this run dir itself, in what only its owner can set: its standard output
  (squeue's StdOut, which launch.slurm puts under RUN_DIR/slurm/) lies inside the run dir, or its
  comment is `torchlaunch:run=<digest of the run dir's real path>`, which a launcher running inside
  a job (a user's own sbatch script) sets at start. A forged record in run dir X naming a job of run
  dir V fails both: the job's output and comment name V.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
from pathlib import Path

from torchlaunch import contract
from torchlaunch.base import files

TOKEN_ENV = contract.LAUNCH_TOKEN
DIGEST_KEY = "token_sha256"
"""The record's extra field holding the token's digest."""
QUERY_TIMEOUT_S = 20


def new_token() -> str:
    return secrets.token_hex(16)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            text = files.read_range(f"/proc/{pid}/task/{task}/children", 0, 1 << 16)[0].decode()
        except (OSError, UnicodeDecodeError):
            continue
        found.extend(int(c) for c in text.split() if c.isdigit())
    return found


def _environ_token(pid: int) -> str | None:
    try:
        raw = files.read_range(f"/proc/{pid}/environ", 0, 1 << 20)[0]
    except OSError:
        return None
    prefix = f"{TOKEN_ENV}=".encode()
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode("ascii", "replace")
    return None


def local_launcher(pid: int, recorded: str | None) -> str | None:
    """None when `pid` is proven this run's launcher, else why not (one clause for the refusal)."""
    if not recorded:
        return "the record holds no launch token digest (written by an older version, or forged)"
    for child in _children(pid):
        token = _environ_token(child)
        if token is not None and secrets.compare_digest(digest(token), recorded):
            return None
    return "none of its children holds the launch token the record names (the record is not this run's)"


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
