"""The Slurm backend's operate side: a job's state, whether it still owns its run dir, its logs, and its
cancel (status, logs, cancel, list), asked of the cluster through backends.slurm.cluster.

A machine without the Slurm tools must never conclude that a job is over and take over its run dir:
every question answers "cannot say" there (cluster). The submission artefact and the command line are
torchlaunch.backends.slurm.launch's (render: the sbatch script); following a job to its end (`--wait`) is
backends.slurm.follow's; the in-task runtime (requeue) is backends.slurm.task's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchlaunch import backends, contract, rundir
from torchlaunch.backends import Detected, JobState, LaunchRecord, Step
from torchlaunch.backends.slurm import proof as slurm_proof
from torchlaunch.backends.slurm import successor as slurm_successor
from torchlaunch.backends.slurm.cluster import controller_state, have, state
from torchlaunch.backends.slurm.states import SLURM_ID, TERMINAL_STATES, job_word
from torchlaunch.exit_codes import BadInput


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

    def state(self, job_id: str, extra: Mapping[str, str]) -> JobState | None:
        """The job's state. A live job's successor (backends.slurm.successor) is named in a note while it
        waits behind a job still going, so an operator reading the queue knows whose pending job it is; once
        the job ended failed (its batch host lost) the successor's state is the run's, as it carries
        the run on."""
        said = state(job_id)
        word = job_word(said)
        after = extra.get(slurm_successor.SUCCESSOR_KEY, "")
        if not SLURM_ID.match(after) or (word is not None and word.word not in ("failed", "pending", "running")):
            return word
        then = state(after)
        going = job_word(then)
        if then is None or going is None or then.split()[0] not in slurm_successor.WAITING_STATES:
            return word
        if word is not None and word.word != "failed":
            why = "it resumes the run from the newest checkpoint if this job's batch host is lost"
            return JobState(word.word, word.said, note=f"successor job {after} is {then} behind job {job_id}: {why}")
        why = f"it resumes the run from the newest checkpoint if job {job_id}'s batch host was lost"
        return JobState(going.word, f"{said or 'gone'} for job {job_id}; its successor job {after} is {then} ({why})")

    def alive(self, job_id: str) -> bool:
        """Pending, running or requeued still owns the run dir; without squeue nobody can tell: alive."""
        if not have("squeue"):
            return True
        return controller_state(job_id) not in ("UNKNOWN", *TERMINAL_STATES)

    def cancel(self, run_dir: Path, nodes: Sequence[LaunchRecord]) -> list[Step]:
        """scancel, once Slurm says the job is this run's (its output under the run dir, or its comment).
        A live job's successor (backends.slurm.successor) is cancelled first, so that the job's CANCELLED
        never starts it; a job already ended whose successor carries the run on: the successor alone."""
        node0 = min(nodes, key=lambda r: r.node_rank)
        if not node0.job_id or not SLURM_ID.match(node0.job_id):
            from torchlaunch.backends.launchers import signal_launchers

            return signal_launchers(nodes)
        steps = [Step("run", ("scancel", after)) for after in successors(run_dir, node0)]
        if steps and controller_state(node0.job_id) in ("UNKNOWN", *TERMINAL_STATES):
            return steps
        why = slurm_proof.slurm_job(node0.job_id, run_dir)
        if why is not None:
            raise BadInput(f"launch error: cancel refused: Slurm job {node0.job_id} is not proven this run's: {why}")
        return [*steps, Step("run", ("scancel", node0.job_id))]

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
        slurm_proof.claim_slurm_job(job_id, run_dir)

    launcher = "torchlaunch.backends.slurm.launch"

    def render(self, spec: Any, options: Any) -> str:
        """The sbatch script submitit would submit (launch.slurm.sbatch_script)."""
        return str(backends.load_launcher(self.launcher).sbatch_script(spec, options))

    def submit(self, argv: Sequence[str]) -> int:
        return int(backends.load_launcher(self.launcher).main(list(argv)))


BACKEND = Slurm()


def successors(run_dir: Path, node0: LaunchRecord) -> list[str]:
    """The successor job waiting or running behind the record's job (its record's extra, else the job's
    chain record), when Slurm says it is this run's (its output under the run dir). A record naming a job
    that is not this run's refuses the cancel (BadInput), as the job's own does."""
    job = node0.job_id or ""
    after = node0.extra.get(slurm_successor.SUCCESSOR_KEY, "")
    if not SLURM_ID.match(after):
        chain = slurm_successor.read(run_dir, job)
        after = chain.successor if chain is not None and chain.successor else ""
    if not after or controller_state(after) not in slurm_successor.WAITING_STATES:
        return []
    why = slurm_proof.slurm_job(after, run_dir)
    if why is not None:
        raise BadInput(
            f"launch error: cancel refused: Slurm job {after}, recorded as job {job}'s successor, is not proven this run's: {why}"
        )
    return [after]
