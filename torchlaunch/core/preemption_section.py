"""The preemption section (`preemption.*`): which signals mean "checkpoint and stop", and how long the
scheduler waits between the signal and the kill.

Why a module of its own: torchlaunch.core.preemption installs the handler in a rank; the launchers
validate this section (torchlaunch.config) before any rank starts, and load nothing of the handler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchlaunch.base.rules import at_least, choice
from torchlaunch.stop_signals import STOP_SIGNAL_NAMES

MAX_LEAD_TIME_S = 7 * 86400.0
KNOWN_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGCONT")


@dataclass
class PreemptionConfig:
    signals: list[str] = field(default_factory=lambda: list(STOP_SIGNAL_NAMES), metadata=choice(KNOWN_SIGNALS))
    """Signals that mean "checkpoint and stop": the handler only sets a flag."""
    lead_time_s: float = field(default=0.0, metadata=at_least(0, MAX_LEAD_TIME_S, "use 0 when unknown"))
    """Seconds between the signal and the hard kill (Slurm signal delay, k8s grace); 0 = unknown.
    A warning is printed when it is below 3x the measured save time."""
