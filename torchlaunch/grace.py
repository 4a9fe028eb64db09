"""The platform's grace: how long a stopped job has between the stop signal and the SIGKILL (stdlib only).

The graces are the world's, not ours: Kubernetes' terminationGracePeriodSeconds (30 s by default; the
manifests launch.k8s renders size it and give it to the container as TORCHLAUNCH_GRACE_S), `docker stop`
(10 s unless --stop-timeout), spot and preemptible VMs (30 s), Slurm's --signal lead time (launch.slurm
passes it as preemption.lead_time_s). Where nothing states it, a launcher assumes the shortest common
one, docker's 10 s, rather than a window that a platform cuts short.

What reads it: launch.local sets torchrun's SIGTERM -> SIGKILL window from it (a window longer than the
grace only meant the platform killed the launcher before it could record the end; a fixed 30 s was
longer than docker's grace), and the ranks' first save-time check (worker/lead_time.py) warns at start
when a checkpoint would not fit in it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

GRACE_ENV = "TORCHLAUNCH_GRACE_S"
"""Seconds between the stop signal and the platform's SIGKILL, where the platform (or a person) says."""

SHORTEST_COMMON_S = 10.0
"""`docker stop`'s default: the shortest grace a common platform gives, assumed where none is stated."""

LAUNCHER_MARGIN_S = 2.0
"""What the launcher keeps of the grace after its ranks' window: reading their reports, its records and
its exit code, before the platform's SIGKILL."""

MAX_GRACE_S = 24 * 3600.0


def platform_grace(env: Mapping[str, str]) -> tuple[float, str]:
    """(seconds, where the figure came from). A value that is not a positive number of seconds is
    ignored (the shortest common grace is assumed): a grace is never a reason to refuse a stop."""
    raw = env.get(GRACE_ENV)
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and 0 < seconds <= MAX_GRACE_S:
            return seconds, GRACE_ENV
    return SHORTEST_COMMON_S, "assumed: docker stop's default, the shortest common grace"


def ranks_window_s(grace_s: float) -> int:
    """torchrun's SIGTERM -> SIGKILL window for the ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, whole seconds):
    the grace less the launcher's margin, at least 1 s."""
    return max(1, math.floor(grace_s - LAUNCHER_MARGIN_S))
