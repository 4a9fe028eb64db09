"""The backends: one package per scheduler (local/, slurm/, k8s/), found through one registry.

Each package owns its scheduler's launch side (launch.py), operate side (operate.py) and, where the
scheduler runs our code, its in-task side (slurm/task.py); no backend imports another's modules (what
two share lives here, launchers.py, or lower: torchlaunch.launch, torchlaunch.jobs, torchlaunch.base).

The registry and the interface a backend implements are owned one floor down, by
torchlaunch.jobs.schedulers (the job record and the operator commands ask it, and they must not import
the backends that write that record); they are named here too, so a backend, built-in or third-party,
writes `from torchlaunch import backends` and `backends.JobState(...)` as before.
"""

from __future__ import annotations

from torchlaunch.jobs.schedulers import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    WORDS,
    Backend,
    Detected,
    JobState,
    LaunchRecord,
    Step,
    alive,
    detect,
    entry_point_targets,
    get,
    load,
    load_launcher,
    names,
    register,
    unregister,
)

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "WORDS",
    "Backend",
    "Detected",
    "JobState",
    "LaunchRecord",
    "Step",
    "alive",
    "detect",
    "entry_point_targets",
    "get",
    "load",
    "load_launcher",
    "names",
    "register",
    "unregister",
]
