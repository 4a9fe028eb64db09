"""The batch plan on the ranks left after a loss, and the record of each regroup.

The plan (core/sampler.py) makes a global step's samples and augmentation draws a function of
(seed, epoch, step) alone; the world size only decides how the B samples are split (uneven shares,
the loss weighted by count). So after a loss the survivors need nothing but a new (rank, world size):
the interrupted step is re-run with the same B samples split over fewer ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchlaunch.core.sampler import BatchPlan


def replan(plan: BatchPlan, rank: int, world_size: int) -> BatchPlan:
    """`plan` for this rank's new seat; everything that decides the samples is kept. The grid's
    counts go back to the even split (a straggler's counts were for the old group's ranks)."""
    return dataclasses.replace(plan, rank=rank, world_size=world_size, counts=())


@dataclass(frozen=True)
class Regroup:
    """One regroup as the rank that went through it saw it: what a log line and the events file say."""

    step: int
    """The global step re-run (1-based: the step that was interrupted, or the next one)."""
    old_rank: int
    old_world: int
    rank: int
    world: int
    generation: int
    """The run dir's group generation after the regroup (fence.Fence)."""
    lost_s: float
    """Transport error -> new group formed (the membership service's wait dominates)."""
    during: str = "step"
    """What the loss interrupted, and so what runs again: `step`, `validation` or `checkpoint`; or
    `rejoin`: a rank started again joined (nothing runs again)."""

    def line(self) -> str:
        if self.during == "rejoin":
            return (
                f"live: {self.world - self.old_world} rank(s) started again joined before global step {self.step}: "
                f"group re-formed in {self.lost_s:.2f} s on {self.world} rank(s) (this rank {self.old_rank} -> "
                f"{self.rank}, generation {self.generation}); the state was sent from a live peer and checked"
            )
        again = {
            "step": f"step {self.step} runs again",
            "validation": "the validation runs again",
            "checkpoint": "the checkpoint is saved again",
        }[self.during]
        when = (
            f"at global step {self.step}"
            if self.during == "step"
            else f"in the {self.during} after step {self.step - 1}"
        )
        return (
            f"live: lost {self.old_world - self.world} rank(s) {when}: "
            f"group re-formed in {self.lost_s:.2f} s on {self.world} rank(s) (this rank {self.old_rank} -> "
            f"{self.rank}, generation {self.generation}); {again} on the ranks left"
        )
