"""test_step_agreement: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_step_agreement_gloo.py.
"""

from __future__ import annotations

from torchlaunch.core.dist import DistContext
from torchlaunch.core.preemption import StepAgreement


def test_without_a_group_the_flag_is_read_directly() -> None:
    agreement = StepAgreement(DistContext())
    agreement.post(1, False)
    agreement.post(2, True)
    assert agreement.read(1) is False
    assert agreement.read(2) is True
    assert agreement.drain() is False
