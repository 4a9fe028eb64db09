"""The local backend: a job is a launch.local process on some host, recorded with its pid and start time.

No scheduler answers for it: it is alive while that pid runs (JobRecord.launcher_alive, by_pid), and
it is stopped by SIGTERM to that launcher, which forwards it to the ranks (they checkpoint and exit 75;
the launcher records `cancelled` and exits 3). A launcher on another host gets the exact ssh command.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchlaunch import backends
from torchlaunch.backends import Detected, JobState, LaunchRecord, Step, launchers


class Local:
    name = "local"
    by_pid = True

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        return None  # the fallback: any environment no scheduler claims (backends.detect)

    def state(self, job_id: str, extra: Mapping[str, str]) -> JobState | None:
        return None  # the record and the pid say it all

    def alive(self, job_id: str) -> bool:
        return True  # a local holder is judged by its pid, never by a job id

    def cancel(self, run_dir: Path, nodes: Sequence[LaunchRecord]) -> list[Step]:
        return launchers.signal_launchers(nodes)

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        return []  # the launcher's console is the user's terminal

    def claim(self, job_id: str, run_dir: Path) -> None:
        pass  # proven by the launch token in a child's environment (jobs.proof.local_launcher)

    launcher = "torchlaunch.backends.local.launch"

    def render(self, spec: Any, options: Any) -> str:
        """The command line this node's launcher runs: torchrun, or the single worker itself
        (launch.local.render; `options` is the node's NodePlacement)."""
        return shlex.join(backends.load_launcher(self.launcher).render(spec, options))

    def submit(self, argv: Sequence[str]) -> int:
        """Run the node's ranks in the foreground (a local job is its launcher process)."""
        return int(backends.load_launcher(self.launcher).main(list(argv)))


BACKEND = Local()
