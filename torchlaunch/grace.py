"""The platform's grace: how long a stopped job has between the stop signal and the SIGKILL (stdlib only).

The graces are the world's, not ours: Kubernetes' terminationGracePeriodSeconds (30 s by default; the
manifests launch.k8s renders size it and give it to the container as TORCHLAUNCH_GRACE_S), `docker stop`
(10 s unless --stop-timeout), spot and preemptible VMs (30 s), Slurm's --signal lead time and GraceTime
(launch.slurm passes the shorter as preemption.lead_time_s). Where the platform does not state it:

- in a pod (KUBERNETES_SERVICE_HOST): Kubernetes' default, 30 s;
- in a container (/.dockerenv, /run/.containerenv): docker stop's default, 10 s, the shortest common one;
- elsewhere (a terminal, a VM): torch's own 30 s, which is also a spot VM's. Nothing kills a terminal's
  run after a Ctrl-C, so a shorter window would only cut short a save that had time.

What reads it: launch.local sets torchrun's SIGTERM -> SIGKILL window from it (a window longer than the
grace only meant the platform killed the launcher before it could record the end; a fixed 30 s was
longer than docker's grace), and the ranks' start-up save check (worker/lead_time.py) warns when a
checkpoint would not fit in it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from torchlaunch import contract

GRACE_ENV = contract.GRACE

SHORTEST_COMMON_S = 10.0
"""`docker stop`'s default: the shortest grace a common platform gives, assumed in a container."""

KUBERNETES_DEFAULT_S = 30.0
"""A pod's terminationGracePeriodSeconds when its manifest does not set it."""

NO_PLATFORM_S = 30.0
"""torch's own SIGTERM -> SIGKILL window: where no platform is seen (a terminal, a VM)."""

CONTAINER_MARKS = ("/.dockerenv", "/run/.containerenv")
"""Files docker and podman put in a container's root."""

LAUNCHER_MARGIN_S = 2.0
"""What the launcher keeps of the grace after its ranks' window: reading their reports, its records and
its exit code, before the platform's SIGKILL."""

MAX_GRACE_S = 24 * 3600.0


def in_container(marks: tuple[str, ...] = CONTAINER_MARKS) -> bool:
    return any(os.path.exists(mark) for mark in marks)


def platform_grace(env: Mapping[str, str], container: bool | None = None) -> tuple[float, str]:
    """(seconds, where the figure came from). A value that is not a positive number of seconds is
    ignored (the platform's default is assumed): a grace is never a reason to refuse a stop."""
    raw = contract.get(GRACE_ENV, env=env)
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and 0 < seconds <= MAX_GRACE_S:
            return seconds, GRACE_ENV
    if contract.get(contract.KUBERNETES_SERVICE_HOST, env=env):
        return KUBERNETES_DEFAULT_S, "assumed: a pod's default terminationGracePeriodSeconds"
    if in_container() if container is None else container:
        return SHORTEST_COMMON_S, "assumed: docker stop's default, the shortest common grace"
    return NO_PLATFORM_S, "assumed: no platform seen, torch's own window"


def ranks_window_s(grace_s: float) -> int:
    """torchrun's SIGTERM -> SIGKILL window for the ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, whole seconds):
    the grace less the launcher's margin, at least 1 s."""
    return max(1, math.floor(grace_s - LAUNCHER_MARGIN_S))
