"""test_ops_launcher: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_ops_launcher.py.
"""

from __future__ import annotations

import pytest

from torchlaunch.exit_codes import BAD_INPUT, CANCELLED, FAILURE, OK, PREEMPTED
from torchlaunch.jobs import launcher


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
