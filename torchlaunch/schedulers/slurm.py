"""The Slurm backend: what a running job needs from the cluster (squeue, sacct, scontrol, scancel).

Every query is bounded by a timeout and answers "cannot say" (None, UNKNOWN, or alive) when the
tool is missing or fails: a machine without the Slurm tools must never conclude that a job is over
and take over its run dir. The submission artefact (the submitit executor) and the in-task runtime
(requeue, the result record) are torchlaunch.launch.slurm's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchlaunch import contract, rundir
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import proof
from torchlaunch.schedulers import Detected, Step

if TYPE_CHECKING:
    from torchlaunch.jobs.record import JobRecord

QUERY_TIMEOUT_S = 10.0
SLURM_ID = re.compile(r"^\d+(_\d+)?(\+\d+)?$")
"""A job id as Slurm writes it (array and heterogeneous forms): only such a string reaches a command."""
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _run(argv: list[str], timeout: float = QUERY_TIMEOUT_S) -> str | None:
    """The command's stdout; None when the tool is missing, fails or times out."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def have(tool: str) -> bool:
    """Whether this machine has the Slurm command `tool` (a login node has; a laptop has not)."""
    return shutil.which(tool) is not None


def controller_state(job_id: str) -> str:
    """The job's live state from slurmctld: RUNNING while a timeout or preemption signal is pending,
    COMPLETING once scancel or the hard time limit is ending it."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    return out.strip() or "UNKNOWN"


def job_state(job_id: str) -> str:
    """The job's state from accounting (first word: "CANCELLED by 0" -> "CANCELLED")."""
    try:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else "UNKNOWN"


def scontrol_state(job_id: str) -> str:
    """The job's state from `scontrol show job` (slurmctld's memory of finished jobs, MinJobAge), which
    knows a job's end even where accounting has no record of it."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    for word in out.split():
        if word.startswith("JobState="):
            return word.partition("=")[2] or "UNKNOWN"
    return "UNKNOWN"


LIVE_STATES = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "CONFIGURING", "RUNNING", "SUSPENDED")
"""States in which a job goes on: a source saying one of these outweighs another's terminal state (after a
node failure, sacct's last record is the failed allocation's NODE_FAIL while slurmctld has requeued it)."""
NODE_FAIL_REQUEUE_S = 60.0
"""How long --wait keeps following a job that ended NODE_FAIL for its requeue to show (PENDING): every
source says NODE_FAIL for a moment before slurmctld requeues a --requeue job (measured: under 1 s)."""
STATE_SOURCES: tuple[Any, ...] = (job_state, scontrol_state)
"""Asked in order on every poll of `--wait`; the first that names a terminal state ends it."""


def state(job_id: str) -> str | None:
    """squeue while the job is known to the controller, else sacct's final state (status, list)."""
    if not SLURM_ID.match(job_id):
        return None
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if out and out.strip():
        return out.split()[0]
    out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    lines = [ln.strip() for ln in (out or "").splitlines() if ln.strip()]
    return lines[-1] if lines else None


class Slurm:
    name = "slurm"
    by_pid = False

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        """A Slurm allocation (SLURM_JOB_ID, the array form when there is one)."""
        array, task = env.get(contract.SLURM_ARRAY_JOB_ID), env.get(contract.SLURM_ARRAY_TASK_ID)
        if array and task:
            return Detected(self.name, f"{array}_{task}")
        if env.get(contract.SLURM_JOB_ID):
            return Detected(self.name, env[contract.SLURM_JOB_ID])
        return None

    def state(self, job_id: str, extra: Mapping[str, str]) -> str | None:
        return state(job_id)

    def alive(self, job_id: str) -> bool:
        """Pending, running or requeued still owns the run dir; without squeue nobody can tell: alive."""
        if not have("squeue"):
            return True
        return controller_state(job_id) not in ("UNKNOWN", *TERMINAL_STATES)

    def cancel(self, run_dir: Path, nodes: Sequence[JobRecord]) -> list[Step]:
        """scancel, once Slurm says the job is this run's (its output under the run dir, or its comment)."""
        node0 = min(nodes, key=lambda r: r.node_rank)
        if not node0.job_id or not SLURM_ID.match(node0.job_id):
            from torchlaunch.schedulers.local import signal_launchers

            return signal_launchers(nodes)
        why = proof.slurm_job(node0.job_id, run_dir)
        if why is not None:
            raise BadInput(f"launch error: cancel refused: Slurm job {node0.job_id} is not proven this run's: {why}")
        return [Step("run", ("scancel", node0.job_id))]

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        """submitit's per-task output files (RUN_DIR/slurm/JOB_ID/JOB_ID_TASK_log.out and .err)."""
        if not job_id or not SLURM_ID.match(job_id):
            return []
        folder = rundir.slurm(run_dir) / job_id
        try:
            return sorted(folder.glob(f"{job_id}_*_log.*"))
        except OSError:
            return []

    def claim(self, job_id: str, run_dir: Path) -> None:
        proof.claim_slurm_job(job_id, run_dir)


BACKEND = Slurm()
