"""test_ops_launcher: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_ops_launcher_hang.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchlaunch.exit_codes import BAD_INPUT, CANCELLED, FAILURE, OK, PREEMPTED
from torchlaunch.jobs import launcher, record, schedulers


@pytest.mark.parametrize(
    ("code", "cancelled", "hung", "outcome", "exit_code"),
    [
        (OK, False, False, "finished", OK),
        (BAD_INPUT, True, False, "bad_input", BAD_INPUT),
        (PREEMPTED, False, False, "preempted", PREEMPTED),
        (PREEMPTED, True, False, "cancelled", CANCELLED),
        (FAILURE, True, False, "cancelled", CANCELLED),
        (FAILURE, False, False, "failed", FAILURE),
        (-9, False, True, "hung", FAILURE),
    ],
)
def test_outcome_and_exit_code(code: int, cancelled: bool, hung: bool, outcome: str, exit_code: int) -> None:
    got = launcher.outcome_of(code, cancelled=cancelled, hung=hung)
    assert (got, launcher.exit_code_of(got, code)) == (outcome, exit_code)


class ClaimWatcher:
    """A scheduler whose claim notes whether the launch record already named the job when it came."""

    name = "claim-watcher"

    def __init__(self) -> None:
        self.record_existed: list[bool] = []

    def claim(self, job_id: str, run_dir: Path) -> None:
        self.record_existed.append(record.record_path(run_dir, 0).exists())


def test_the_job_is_claimed_before_the_record_names_it(tmp_path: Path) -> None:
    """`cancel` proves a job from its scheduler (the claim) once a record names it: a claim after the record
    left a window in which a cancel found the record and was refused (a Slurm job seen running, refused)."""
    watcher = ClaimWatcher()
    schedulers.register(watcher)  # type: ignore[arg-type]
    try:
        op = launcher.Operation(tmp_path, scheduler=watcher.name, command=["train"], launch_id="L1", job_id="7")
        rec = op.start()
    finally:
        schedulers.unregister(watcher.name)
    assert watcher.record_existed == [False]
    assert record.record_path(tmp_path, 0).exists() and rec.job_id == "7"
