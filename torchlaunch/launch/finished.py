"""A rerun of a finished run: the launcher says so and exits 0 before anything starts.

Why: the README promises that a finished run's command, run again, "exits 0 at once". The ranks did
find nothing left to train, but only after torchrun, every rank's torch import, the data and the model
(10-14 s on a 2-core box), and each such rerun overwrote the heartbeats and the job record of the run
(a failed start relabelled a finished run `failed`). The run dir says it already, torch-free: the last
launch recorded `finished` on every node, and the model it saved is newer than the config it trained
(a --reconfigure since, such as more epochs, rewrote config.yaml: then the ranks decide, as before).
"""

from __future__ import annotations

import os
import sys

from torchlaunch import rundir
from torchlaunch.base.untrusted import quote
from torchlaunch.jobs import record
from torchlaunch.jobs.state import current_launch


def finished(run_dir: str | os.PathLike[str]) -> bool:
    """Whether `run_dir`'s last launch finished the run it holds the config of (read-only, no torch)."""
    records, _ = record.read_all(run_dir)
    nodes = current_launch(records)
    if not nodes or any(r.outcome != "finished" for r in nodes):
        return False
    try:
        return rundir.model(run_dir).stat().st_mtime >= rundir.config(run_dir).stat().st_mtime
    except OSError:  # no model saved (or no config): the ranks decide
        return False


def already(run_dir: str | os.PathLike[str], *, changed: bool, one_node: bool) -> bool:
    """True (after its one line on stderr) when this launch has nothing to do: the run finished and
    this launch neither changed its config (`changed`: --reconfigure, --doctor's own) nor is one node
    of several (each node's launcher must take the same decision; the ranks' own check stands there)."""
    if changed or not one_node or not finished(run_dir):
        return False
    shown = quote(str(run_dir), 200)
    print(
        f"launch: {shown} finished already: nothing to train (exit 0); its model is "
        f"{quote(str(rundir.model(run_dir)), 200)}, `python -m launch status {shown}` shows the run",
        file=sys.stderr,
        flush=True,
    )
    return True
