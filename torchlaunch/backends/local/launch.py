"""The local backend's launch side: a local job is the node agent (torchlaunch.agent) run in the
foreground on this host. The agent is not this backend's own, since every Kubernetes pod runs it too;
this module is what the backend registry loads for a local job (schedulers.load_launcher)."""

from __future__ import annotations

from collections.abc import Sequence

from torchlaunch.agent import commands, node
from torchlaunch.agent.commands import NodePlacement
from torchlaunch.launch.spec import JobSpec


def render(spec: JobSpec, placement: NodePlacement) -> list[str]:
    """The node's command for `spec` (pure): torchrun, or the single worker itself."""
    return commands.render(spec, placement)


def main(argv: Sequence[str] | None = None) -> int:
    """Run this node's ranks in the foreground (`torchlaunch-local`, the registry's submit)."""
    return node.main(argv)
