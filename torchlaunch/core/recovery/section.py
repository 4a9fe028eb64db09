"""The recovery section (`recovery.*`): live recovery's switch and its membership service's timings.

Why a module of its own, torch-free like the package's __init__: the launchers and the live agent
validate this section (torchlaunch.config, backends/k8s/live.py) before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchlaunch.base.rules import at_least, bound, service_address

LIVE_BY_DEFAULT = False
"""recovery.live's default: the one switch that makes live recovery every multi-rank run's road (issue
#54). Not flipped yet: Kubernetes still needs recovery.lighthouse (or its rendered Deployment) across
nodes, which launch.local's node agents and Slurm's tasks place by themselves (agent/placed.py)."""


@dataclass
class RecoveryConfig:
    live: bool = LIVE_BY_DEFAULT
    """Live recovery (launch.local and Slurm: one node, or several, the membership service placed on one
    of them through the run dir; Kubernetes with its rendered service or recovery.lighthouse): when a rank's process
    or a whole node is lost, the others keep their processes and state, re-form the group in place and
    re-run the interrupted step on the ranks left (same samples, same augmentation). Off: a lost rank fails the job, which resumes from a checkpoint.
    docs/live.md."""
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
