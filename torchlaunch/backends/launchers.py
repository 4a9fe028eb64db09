"""Stopping a job whose ranks run under launcher processes on hosts: shared by every backend that
records such launchers (local; and Slurm or Kubernetes jobs started through launch.local inside an
allocation or a pod), so no backend reaches into another for it."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from torchlaunch.backends import LaunchRecord, Step
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import proof


def signal_launchers(nodes: Sequence[LaunchRecord]) -> list[Step]:
    """SIGTERM to each live launcher of this launch on this host, once proven this run's (jobs.proof);
    the ssh command for one on another host."""
    steps: list[Step] = []
    here = socket.gethostname()
    for n in nodes:
        if n.outcome is not None or n.launcher_pid is None:
            continue
        if n.host == here and n.launcher_alive() and n.launcher_pid != os.getpid():
            why = proof.local_launcher(n.launcher_pid, n.extra.get(proof.DIGEST_KEY))
            if why is not None:
                raise BadInput(
                    f"launch error: cancel refused: pid {n.launcher_pid} is not proven this run's launcher: {why}"
                )
            steps.append(Step("signal", pid=n.launcher_pid))
        elif n.host != here:
            steps.append(Step("print", ("ssh", n.host or "?", "kill", "-TERM", str(n.launcher_pid))))
    return steps
