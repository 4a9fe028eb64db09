"""The fewest ranks a live group trains on: below it, the ranks left checkpoint and stop for a requeue.

A launcher that was given a node range (Slurm's `--nodes MIN-MAX`, launch.local's `--nnodes MIN:MAX`) asked for at least MIN nodes: a
live group that a loss leaves with fewer than MIN nodes' worth of ranks must not train on. The ranks
left have formed their group already (so they can agree); they commit a checkpoint at the last whole
step through the usual path (a failed save keeps the previous checkpoint) and end with the preemption
code 75, which the launcher's own requeue path turns into a new allocation of MIN..MAX nodes that
resumes from that checkpoint (the plan keeps the global batch on any world size).

One owner for the rule: the launcher only passes MIN and the words the user said it with
(contract.LIVE_MIN_NODES, contract.LIVE_NODE_RANGE); the rank reads them here (from_env), the live
group checks them where each new quorum is taken (group.LiveGroup.check_minimum), and the trainer acts on
BelowMinimum. Torch-free and pure apart from from_env.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchlaunch import contract
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BadInput

last_stop = ""
"""This process's stop below the minimum ('' when none): the Slurm task, which runs the worker in its own
process, names it in its requeue line rather than calling the stop a preemption (as runner.last_reason)."""


first_at_stop = False
"""Whether this process was its live group's rank 0 when it stopped below the minimum: the Slurm task
requeues the job from it (the launch's rank 0 may be the one that was lost)."""


class BelowMinimum(Exception):
    """A regroup left the live group below its minimum: checkpoint at the last whole step, exit 75."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        """`1 node left, below --nodes 2-3's minimum of 2 nodes` (Minimum.short)."""

    def committed(self, step: int) -> str:
        """The line once the checkpoint is committed: what happened, in the user's words."""
        return f"live: {self.why}: checkpoint committed at global step {step}; exit 75 so that the job is requeued"


@dataclass(frozen=True)
class Minimum:
    """MIN nodes' worth of ranks, as the launcher was asked for them."""

    nodes: int
    """MIN of the node range."""
    ranks_per_node: int
    """This launch's ranks per node (every node runs as many)."""
    said: str
    """How the user asked for it, quoted in the line (`--nodes 2-3`)."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def short(self, world: int) -> str | None:
        """Why a group of `world` ranks may not train on, or None when it may (pure)."""
        if world >= self.ranks:
            return None
        if world % self.ranks_per_node == 0:
            left = f"{world // self.ranks_per_node} node{'s' if world // self.ranks_per_node != 1 else ''} left"
        else:
            left = f"{world} rank(s) left ({self.ranks_per_node} per node)"
        return f"{left}, below {self.said}'s minimum of {self.nodes} node{'s' if self.nodes != 1 else ''}"


def below_minimum(minimum: Minimum | None, world: int) -> None:
    """BelowMinimum when a group of `world` ranks is below `minimum` (pure; None: no minimum)."""
    why = minimum.short(world) if minimum is not None else None
    if why is not None:
        raise BelowMinimum(why)


def passed(min_nodes: int, said: str) -> dict[str, str]:
    """What a launcher given a node range sets in its ranks' environment (pure): MIN, and the range in
    the words the user gave it (`--nnodes 1:2`), which the rank's line quotes."""
    return {contract.LIVE_MIN_NODES: str(min_nodes), contract.LIVE_NODE_RANGE: said}


def from_env(ranks_per_node: int, env: Mapping[str, str] | None = None) -> Minimum | None:
    """The minimum the launcher passed this rank, or None (no node range: the group trains on to one rank).
    A value that is not a count of nodes >= 1 is bad input, one line."""
    got = contract.get(contract.LIVE_MIN_NODES, "", env) or ""
    if not got:
        return None
    count = whole(got, 6)
    if count is None or count < 1:
        raise BadInput(f"live error: {contract.LIVE_MIN_NODES}={got[:20]!r} is not a node count >= 1")
    said = "".join(c if c.isprintable() else " " for c in contract.get(contract.LIVE_NODE_RANGE, "", env) or "")[:60]
    return Minimum(count, max(ranks_per_node, 1), said.strip() or "the launch")
