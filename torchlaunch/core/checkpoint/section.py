"""The checkpoint section (`checkpoint.*`): when checkpoints are written, how many are kept, which one a
run resumes from.

Why a module of its own, torch-free: the launchers build and validate the whole config
(torchlaunch.config) before any rank starts, without torch; the store and the Checkpointer beside it
read these values in the rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchlaunch.base.rules import MAX_EPOCHS, MAX_STEPS, at_least, choice


@dataclass
class CheckpointConfig:
    every_steps: int = field(default=0, metadata=at_least(0, MAX_STEPS, "use 0 for epoch-end checkpoints only"))
    """Checkpoint every N optimizer steps (0 = only at epoch ends)."""
    every_epochs: int = field(default=1, metadata=at_least(0, MAX_EPOCHS, "e.g. checkpoint.every_epochs=1"))
    """Checkpoint at the end of every N epochs (0 = never at epoch ends)."""
    keep: int = field(default=2, metadata=at_least(2, 10_000, "keep at least 2 so a corrupt newest one has a fallback"))
    """Newest checkpoints kept (>= 2); the best by validation accuracy is kept too."""
    resume: str = "auto"
    """`auto` (newest checkpoint that verifies), `never`, or the path of a checkpoint folder."""
    async_save: bool = True
    """Write periodic checkpoints in the background; the preemption save is always synchronous."""
    format: str = field(default="single_file", metadata=choice(("single_file", "dcp")))
    """`single_file` (rank 0 writes state.pt) or `dcp` (torch.distributed.checkpoint, each rank its share).
    dcp saves are synchronous; a resume reads the format each checkpoint's marker names."""
