"""Fault injection for tests: a rank signals itself at an exact point of the loop.

TORCHLAUNCH_FAULT_SIGNAL="at=step|val|save,n=N[,rank=R][,sig=SIGTERM]" makes rank R send itself a
real signal after global step N, during validation of epoch N, or right after the checkpoint of
step N, so resume tests hit every interruption point reproducibly through the real signal path.
Only the first attempt of a launch fires (TORCHELASTIC_RESTART_COUNT=0): a restarted group resumes.
"""

from __future__ import annotations

import os
import signal

from torchlaunch import contract

ENV = contract.FAULT_SIGNAL


class FaultSignal:
    """Call `fault(at, n)` at each injection point; it fires at most once, where the spec says."""

    def __init__(self, spec: str | None, rank: int) -> None:
        fields = dict(kv.split("=", 1) for kv in spec.split(",")) if spec else {}
        self.at = fields.get("at")
        self.n = int(fields.get("n", "-1"))
        first_attempt = contract.get(contract.RESTART_COUNT, "0") == "0"  # once per launch
        self.active = bool(spec) and int(fields.get("rank", "0")) == rank and first_attempt
        self.signum = getattr(signal, fields.get("sig", "SIGTERM"))
        self.fired = False

    @classmethod
    def from_env(cls, rank: int) -> FaultSignal:
        return cls(contract.get(ENV), rank)

    def __call__(self, at: str, n: int) -> None:
        if self.active and not self.fired and at == self.at and n == self.n:
            self.fired = True
            os.kill(os.getpid(), self.signum)
