"""The one evaluation loop: loss and top-1 over this rank's shard, summed over every rank.

Used by the Trainer's validation and by `python -m torchlaunch.worker.evaluate`, so the accuracy the
evaluator prints is the run's val_acc on the same split, by construction.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from torchlaunch.core.dist import DistContext, all_reduce_sum
from torchlaunch.worker.tta import tta_logits

Autocast = Callable[[], contextlib.AbstractContextManager]


def evaluate(
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    ctx: DistContext,
    autocast: Autocast = contextlib.nullcontext,
    tta: str = "none",
    rounds: int | None = None,
    stop: Callable[[int], bool] | None = None,
) -> dict[str, float] | None:
    """{"loss", "correct", "samples"} over every rank, each sample counted once; None when stop(i) said so.

    `model` is the bare module, never a DDP wrapper: its forward is a collective, and ranks may hold
    different numbers of batches. `rounds` and `stop`: stop(i) is called before batch i in exactly
    `rounds` rounds on every rank (a rank out of batches still takes part), so a collective inside
    stop, such as an agreed preemption flag, runs in lockstep; without `rounds`, until batches end."""
    sums = [0.0, 0.0, 0.0]
    with torch.no_grad():
        i = 0
        while rounds is None or i < rounds:
            if stop is not None and stop(i):
                return None
            item = next(batches, None)
            i += 1
            if item is None:
                if rounds is None:
                    break
                continue
            x, y = item
            with autocast():
                logits = tta_logits(model, x, tta)
            sums[0] += float(nn.functional.cross_entropy(logits.float(), y, reduction="sum"))
            sums[1] += float((logits.argmax(1) == y).sum())
            sums[2] += y.numel()
    loss_sum, correct, count = all_reduce_sum(ctx, sums)
    return {"loss": loss_sum / count if count else math.nan, "correct": correct, "samples": count}
