"""The training group one rank trains in: the one interface the trainer talks to, whatever the road.

The trainer forms its gradient averaging through it, reduces gradients, agrees on a stop, survives a
lost peer (or not), admits a rank started again and fences a commit, by calling the group; it never
asks which group it has. Two implementations:
- fixed.FixedGroup: torchrun's group as the launcher formed it (DDP, the exact grid, or one rank); a
  lost peer fails the run, which the launcher restarts from the last checkpoint.
- live.LiveTrainingGroup: recovery.live, re-formed in place on a lost rank (live/ holds the
  membership, store, fence and wire; live.py the trainer-side steps). Imported only when a run trains
  live: a worker that does not pays nothing for its imports at start-up (`python -m bench.startup`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from torchlaunch.worker.groups.fixed import FixedGroup

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchlaunch.config import RunConfig
    from torchlaunch.core import checkpoint as ckpt
    from torchlaunch.core.dist import DistContext
    from torchlaunch.core.fixed_point import RankSum
    from torchlaunch.core.sampler import BatchPlan
    from torchlaunch.live.minimum import BelowMinimum
    from torchlaunch.worker.metrics import RunLog, WorldSize

T = TypeVar("T")


class Host(Protocol):
    """What a group reads and moves of the rank's training (worker/trainer.Trainer is the one host)."""

    cfg: RunConfig
    ctx: DistContext
    device: torch.device
    model: nn.Module
    grid: int
    plan: BatchPlan
    progress: Any
    """The run's position (trainer.Progress): global_step, epoch."""
    world: WorldSize
    gradient_path: str
    writer: ckpt.AsyncWriter
    ckpt_root: Path
    last_saved: tuple[int, int, bool] | None
    save_point: int | None

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def resume(self) -> Path | None: ...

    def save(self, synchronous: bool, validated: bool = False, final: bool = False) -> None: ...

    def abandon_step(self) -> None: ...

    def group_changed(self, plan: BatchPlan, window: Any) -> None: ...

    def _publish_final_model(self, log: RunLog) -> None: ...


class TrainingGroup(Protocol):
    """One rank's group, as the trainer uses it."""

    joining: bool
    """A rank started again that takes a peer's state rather than a checkpoint (recovery.rejoin)."""
    joined: dict[str, Any] | None
    """Such a rank, once it joined: its joining record (the log's first event)."""
    started_as: int | None
    """The rank that names this rank's files (None: its rank in the group)."""
    reduces_in_backward: bool
    """Whether gradients are averaged inside backward (DDP's last micro-batch), not after it."""
    keeps_grad_views: bool
    """Whether each .grad is a view of a buffer the group keeps (zeroed after a step, never let go)."""
    grid_sum: RankSum | None
    """train.exact's sum over ranks when the group has a faster one than gloo's all-reduce (shared
    memory on one machine), formed by form(); None: the grid sums over gloo (or alone)."""

    @property
    def generation(self) -> int | None:
        """The group's generation for the batch trace (None: a group that never changes)."""

    def form(self, host: Host) -> tuple[nn.Module, str]:
        """Set up how this group averages gradients on the host's model: the module the steps run
        (the model, or DDP around it) and the line that names the way."""

    def start(self, host: Host) -> Path | None:
        """The run's state at start: the resumed checkpoint's path, or None (fresh, or taken from a peer)."""

    def opened(self, log: RunLog) -> None:
        """The rank's log is open: what the group has to say in it first."""

    def completing_backward(self, world_size: int) -> None:
        """Before the backward that completes this rank's gradients of a step (its last micro-batch): a
        group that overlaps its averaging with backward arms it (the others have nothing to do)."""

    def reduce_gradients(self, world_size: int) -> None:
        """After backward: the mean of every member's gradients, where backward did not average them."""

    def zero_gradients(self, optimizer: torch.optim.Optimizer) -> None: ...

    def fence_commit(self) -> Callable[[], AbstractContextManager[None]] | None:
        """Before a save: refuse a rank outside the group; what the commit is held under (None: nothing)."""

    def lost(self, error: BaseException) -> str | None:
        """The first line of a peer's loss this group goes on after (None: the error is the run's)."""

    def surviving(self, host: Host, log: RunLog, during: str, attempt: Callable[[], T]) -> T:
        """`attempt()`, run again on the members left after each loss of a peer this group survives."""

    def recover_step(self, host: Host, log: RunLog, why: str, window: Any) -> None:
        """After `lost` named a loss during a step: regroup, so the interrupted step can run again."""

    def asks_to_join(self) -> bool:
        """Whether a rank started again asks to join (voted at check points)."""

    def admit(self, host: Host, log: RunLog, window: Any) -> None:
        """Every member agreed to admit it: the group with it, and its state sent."""

    def stepped(self, log: RunLog, step: int) -> None:
        """A training step done."""

    def finish(self, host: Host, log: RunLog) -> None:
        """Training is over: the final checkpoint committed and model.pt published."""

    def below_minimum(self, host: Host, log: RunLog, below: BelowMinimum) -> int:
        """The group shrank below the launcher's minimum: the exit code, once a checkpoint is committed."""

    def close(self) -> None: ...


def form(cfg: RunConfig, ctx: DistContext, attempt: int = 0) -> TrainingGroup:
    """The group this rank trains in, formed by its road's former (the road registry, torchlaunch.roads,
    names it: fixed.form or live.form): live (more than one rank or a rank started again, on the live road)
    or the launcher's fixed group. The launcher chose the road (recovery.live auto: live where its road
    can be); a live launcher hands its ranks the membership service's address, so under auto a rank
    without one trains in the fixed group, and an explicit true without one is refused by live.join
    (bad input). Every rank agrees on a bad input while seating itself."""
    from torchlaunch import contract, roads

    launched_live = bool(contract.get(contract.LIGHTHOUSE)) or roads.get("live").insisted(cfg.recovery.live)
    road = roads.choose(cfg.recovery.live, launched_live) if (ctx.distributed or attempt) else roads.RESTART
    return roads.load(road.group)(cfg, ctx, attempt)  # the road's own former (torchlaunch.roads: Road.group)


__all__ = ["FixedGroup", "Host", "TrainingGroup", "form"]
