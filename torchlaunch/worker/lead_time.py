"""Is the scheduler's warning long enough? One probe save timed against preemption.lead_time_s."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from torchlaunch.core import checkpoint as ckpt


def lead_time_warning(
    lead_s: float, probe: Path, state: dict[str, Any], what: str = "preemption.lead_time_s", every_steps: int = 0
) -> str | None:
    """Write `state` once as a checkpoint under `probe` (then removed); a warning line when the lead
    time is below 3x that save time, else None. A preemption save must commit before the hard kill; when
    it cannot, the periodic checkpoints (`every_steps`) are what bounds the loss, so the line says it."""
    start = time.perf_counter()
    ckpt.write_checkpoint(probe, 0, state, {})
    seconds = time.perf_counter() - start
    shutil.rmtree(probe, ignore_errors=True)
    if lead_s >= 3 * seconds:
        return None
    name = f"{what}={lead_s:g}" if what == "preemption.lead_time_s" else f"{what} ({lead_s:g} s for the ranks)"
    bound = (
        f"; a stop then loses up to checkpoint.every_steps={every_steps} steps"
        if every_steps
        else "; a stop then loses up to the steps since the last epoch-end checkpoint (checkpoint.every_steps=0)"
    )
    return (
        f"warning: {name} is below 3x the measured save time "
        f"({seconds:.2f} s): a preemption may kill the job before its checkpoint commits{bound} "
        f"(raise the scheduler's signal lead time / grace period)"
    )
