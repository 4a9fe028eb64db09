"""The dist section (`dist.*`): the process group's timeout and backend, and how CPU ranks share a machine.

Why apart from torchlaunch.core.dist: that module imports torch, and the launchers validate this
section (torchlaunch.config) before any rank starts, without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchlaunch.base.rules import bound, choice

MAX_TIMEOUT_S = 30 * 86400.0
"""The longest process-group timeout: finite (a timedelta and torch's milliseconds must hold it)."""


MIN_TIMEOUT_S = 10.0
"""The shortest process-group timeout: below it a healthy collective (a checkpoint gather, the first
NCCL set-up) fails for want of time, not because a peer is lost."""


@dataclass
class DistConfig:
    timeout_s: float = field(
        default=300.0,
        metadata=bound(
            lambda v: MIN_TIMEOUT_S <= v <= MAX_TIMEOUT_S,
            f"must be at least {MIN_TIMEOUT_S:.0f} and at most {MAX_TIMEOUT_S:.0f} (30 days)",
            "e.g. 300",
        ),
    )
    """Process-group timeout: a lost peer fails the collective after this many seconds. The group's
    start (every rank arriving) waits at least 300 s (torchlaunch.core.dist.START_WAIT_S)."""
    backend: str = field(default="auto", metadata=choice(("auto", "nccl", "gloo")))
    """`auto` (nccl on CUDA, gloo on CPU), `nccl` or `gloo`."""
    pin_cpus: bool = True
    """CPU workers sharing a machine: each local rank runs on its own slice of the cores it may use."""
    shared_memory_reduce: bool = True
    """CPU jobs on one machine: average gradients through /dev/shm instead of gloo's TCP ring (same
    numbers, bit for bit; falls back to gloo by itself where /dev/shm is missing or too small)."""
