"""Slurm's job states in the project's words, and the job id that may reach a command (pure).

squeue, sacct and scontrol name a job's state in capitals ("CANCELLED by 1000", "COMPLETED+"); the
operator commands speak torchlaunch.backends.WORDS, and `--wait`, `cancel` and the successor chain ask
whether a state is over or goes on. One table for all of them.
"""

from __future__ import annotations

import re

from torchlaunch.backends import JobState

SLURM_ID = re.compile(r"^\d+(_\d+)?(\+\d+)?$", re.ASCII)
"""A job id as Slurm writes it (array and heterogeneous forms): only such a string reaches a command."""
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

LIVE_STATES = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "CONFIGURING", "RUNNING", "SUSPENDED")
"""States in which a job goes on: a source saying one of these outweighs another's terminal state (after a
node failure, sacct's last record is the failed allocation's NODE_FAIL while slurmctld has requeued it)."""


SLURM_WORDS = {
    "PENDING": "pending",
    "CONFIGURING": "pending",
    "RESV_DEL_HOLD": "pending",
    "SUSPENDED": "pending",
    "REQUEUED": "requeued",
    "REQUEUE_HOLD": "requeued",
    "REQUEUE_FED": "requeued",
    "RUNNING": "running",
    "COMPLETING": "running",
    "STAGE_OUT": "running",
    "RESIZING": "running",
    "SIGNALING": "running",
    "COMPLETED": "finished",
    "CANCELLED": "cancelled",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "PREEMPTED": "preempted",
}
"""squeue's and sacct's job states, in the project's words (torchlaunch.backends.WORDS)."""


def job_word(said: str | None) -> JobState | None:
    """Slurm's state text ("CANCELLED by 1000", "COMPLETED+") in our words; None when unknown."""
    head = said.strip().split()[0].rstrip("+").upper() if said and said.strip() else ""
    word = SLURM_WORDS.get(head)
    return JobState(word, said.strip()) if word is not None and said is not None else None
