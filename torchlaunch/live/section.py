"""The recovery section (`recovery.*`): live recovery's switch and its membership service's timings.

Why a module of its own, torch-free like the package's __init__: the launchers and the live agent
validate this section (torchlaunch.config, backends/k8s/live.py) before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchlaunch.base.rules import at_least, bound, service_address

AUTO = "auto"
"""recovery.live's default: live where the launch's road can be, the restart road where it cannot."""

Live = Literal["auto", True, False]
"""recovery.live's values. Three, not two: the launchers must tell "the user did not say" (auto, the
default) from an explicit true. A road that cannot be live (a program of the user's own, one rank,
--doctor, `launch.k8s --jobset`, Slurm's --image) takes the restart road quietly under auto, and says
so in its road line; an explicit true there is refused as before (exit 2, one line)."""


def runs_live(live: Live, possible: bool) -> bool:
    """Whether a launch takes the live road (issue #54: live whenever the road can be, unless the user
    said false). `possible`: the launch's road can be live. An explicit true where it cannot is refused
    first by the launchers whose road that is (`explicit`); one rank and --doctor have nobody to regroup
    with and take the restart road whatever the key says, as they always did."""
    return live is not False and possible


def explicit(live: Live) -> bool:
    """recovery.live=true written by the user: the launches that cannot be live refuse it (exit 2)."""
    return live is True


@dataclass
class RecoveryConfig:
    live: Live = AUTO
    """Live recovery: auto (default) trains live on every multi-rank run whose road can be, true insists
    (refused where it cannot), false takes the restart road. Live roads: launch.local's nodes, Slurm,
    Kubernetes' Job; not a program of your own, --doctor, --jobset or Slurm's --image. Live: when a rank's process or a whole
    node is lost, the others keep their processes and state, re-form the group in place and re-run the
    interrupted step on the ranks left (same samples, same augmentation). Restart: a lost rank stops every
    rank, and the job resumes from a checkpoint. The launch's road line says which. docs/live.md."""
    heartbeat_timeout_s: float = field(default=1.0, metadata=at_least(0.2, 600, "e.g. 1"))
    """How long the membership service waits for a silent rank's heartbeat before it forms a group
    without it: the bound on noticing a lost rank (heartbeats go every tenth of it)."""
    quorum_timeout_s: float = field(default=60.0, metadata=at_least(1, 3600, "e.g. 60"))
    """How long a survivor waits for the new group to form before it gives up (exit 1)."""
    rejoin: int = field(default=0, metadata=at_least(0, 100, "e.g. 3"))
    """How many times the live agent starts a lost rank again to rejoin the group (0: never). The new
    process builds its model and loaders, waits for the others' next check point (train.log_every_steps)
    and takes its state from a live peer, checked; the others pause about one regroup."""
    lighthouse: str = field(
        default="",
        metadata=bound(
            lambda v: v == "" or service_address(v, ports=2) is not None,
            "must be empty or the membership service's http://HOST:PORT, PORT at most 65534 (PORT+1 is its presence port)",
            "e.g. recovery.lighthouse=http://10.0.0.9:29510, where `python -m launch.lighthouse` serves on a host of its own",
        ),
    )
    """The membership service's address when it runs apart from the training nodes, a service of your
    own. Empty: launch.local places one, beside the ranks of its one node, or across nodes on one of
    the job's nodes through a lease in the run dir (moved when that node is lost)."""
