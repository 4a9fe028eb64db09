"""The local backend: a job is a launch.local process on some host, recorded with its pid and start time.

No scheduler answers for it: it is alive while that pid runs (JobRecord.launcher_alive, by_pid), and
it is stopped by SIGTERM to that launcher, which forwards it to the ranks (they checkpoint and exit 75;
the launcher records `cancelled` and exits 3). A launcher on another host gets the exact ssh command.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchlaunch import schedulers
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import proof
from torchlaunch.schedulers import Detected, Step

if TYPE_CHECKING:
    from torchlaunch.jobs.record import JobRecord


class Local:
    name = "local"
    by_pid = True

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        return None  # the fallback: any environment no scheduler claims (schedulers.detect)

    def state(self, job_id: str, extra: Mapping[str, str]) -> str | None:
        return None  # the record and the pid say it all

    def alive(self, job_id: str) -> bool:
        return True  # a local holder is judged by its pid, never by a job id

    def cancel(self, run_dir: Path, nodes: Sequence[JobRecord]) -> list[Step]:
        return signal_launchers(nodes)

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        return []  # the launcher's console is the user's terminal

    def claim(self, job_id: str, run_dir: Path) -> None:
        pass  # proven by the launch token in a child's environment (jobs.proof.local_launcher)

    launcher = "torchlaunch.launch.local"

    def render(self, spec: Any, options: Any) -> str:
        """The command line this node's launcher runs: torchrun, or the single worker itself
        (launch.local.render; `options` is the node's NodePlacement)."""
        return shlex.join(schedulers.load_launcher(self.launcher).render(spec, options))

    def submit(self, argv: Sequence[str]) -> int:
        """Run the node's ranks in the foreground (a local job is its launcher process)."""
        return int(schedulers.load_launcher(self.launcher).main(list(argv)))


def signal_launchers(nodes: Sequence[JobRecord]) -> list[Step]:
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


BACKEND = Local()
