"""The allocation before this one, when Slurm killed it before its stop's checkpoint committed.

Slurm SIGKILLs a job's tasks when its GraceTime (or the time limit's KillWait) runs out; a task killed
while its ranks were saving leaves no process to say that steps were lost, and Slurm requeues the job:
the next allocation resumes from the last committed checkpoint. What is left is the run dir: node 0's
job record of that allocation without an outcome, and its ranks' heartbeats (flushed at the stop).
The next allocation's rank 0 reads them before it records itself or beats (the other tasks start at
the same time and replace their own beats: rank 0's is the one sure to be left, and every rank beat
the agreed stop step), says the loss in one line and records that allocation's outcome as the
README's code for a stop that lost work (exit 1).
"""

from __future__ import annotations

from pathlib import Path

from torchlaunch.exit_codes import FAILURE
from torchlaunch.jobs import record
from torchlaunch.jobs.lost import unrecorded


def killed_before(run_dir: str | Path, job_id: str, launch_id: str) -> str:
    """The line for the previous allocation of `job_id` when it ended without recording an outcome and
    its ranks had trained past the newest checkpoint, after recording its outcome (failed, exit 1);
    '' when there is none, it recorded its own end, or it lost nothing."""
    records, _ = record.read_all(run_dir)
    previous = next((r for r in records if r.node_rank == 0), None)
    if previous is None or previous.scheduler != "slurm" or previous.job_id != job_id:
        return ""
    if previous.launch_id == launch_id or previous.outcome is not None:
        return ""
    line = unrecorded(Path(run_dir), previous, then="this allocation resumes from there")
    if not line:
        return ""
    try:
        record.finish(run_dir, previous, FAILURE, "failed", line)
    except OSError:  # the line still goes out; this allocation's own record comes next either way
        pass
    return line
