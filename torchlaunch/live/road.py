"""The live road as the launchers meet it: its entry in the road registry (torchlaunch.roads, "live").

The node agent (torchlaunch/agent/: the live agent, the placed service, a live start), the Slurm
backend (its tasks and batch script) and the Kubernetes backend (the membership service's Deployment)
ask `roads.get("live")` or `roads.choose(...)` for this object and reach the live modules they need
through it, instead of importing this package: a launcher names the road, not its implementation.
Torch-free; each part is imported when first asked for, so a launcher that takes the restart road
loads none of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from torchlaunch.live import section


class LiveRoad:
    name = "live"
    regroups = True
    service = "torchlaunch.live.lighthouse"
    group = "torchlaunch.worker.groups.live:form"
    PARTS = ("fence", "placement", "presence", "pulse", "minimum", "runkey")
    """The modules a launcher reads of this road, each a property below."""

    def takes(self, live: Any, possible: bool) -> bool:
        return section.runs_live(live, possible)

    def insisted(self, live: Any) -> bool:
        return section.explicit(live)

    def declined(self, live: Any) -> bool:
        return live is False

    def prepare(self, run_dir: str) -> Any:
        return self.runkey.load(run_dir)

    @property
    def default_bind(self) -> str:
        """Where `python -m launch.lighthouse` (the membership service) listens by default, HOST:PORT."""
        return str(self._part("lighthouse").DEFAULT_BIND)

    # The live road's launch-side parts, each one module of this package (its docstring says what it owns).

    @property
    def fence(self) -> ModuleType:
        """The run dir's group generation (Fence): a lost node's replacement, a first launch's record."""
        return self._part("fence")

    @property
    def placement(self) -> ModuleType:
        """The membership service placed on one of the job's nodes through a lease in the run dir."""
        return self._part("placement")

    @property
    def presence(self) -> ModuleType:
        """The service's presence port beside its Lighthouse (port_of)."""
        return self._part("presence")

    @property
    def pulse(self) -> ModuleType:
        """A rank's beats to its agent, and the agent's Watch that fences a silent rank."""
        return self._part("pulse")

    @property
    def minimum(self) -> ModuleType:
        """The fewest ranks a group trains on (a node range's MIN), and a rank's stop below it."""
        return self._part("minimum")

    @property
    def runkey(self) -> ModuleType:
        """The run's secret and its file (secret_file), shared with the service's Deployment."""
        return self._part("runkey")

    def _part(self, name: str) -> ModuleType:
        assert name in (*self.PARTS, "lighthouse"), name
        return importlib.import_module(f"torchlaunch.live.{name}")


ROAD = LiveRoad()
