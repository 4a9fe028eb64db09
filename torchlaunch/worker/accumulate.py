"""One rank's forward and backward passes of one global step: its micro-batches, the loss of each
weighted so that DDP's average over the ranks is the mean over the global batch (BatchPlan.loss_weight),
gradients synchronised once, on the last micro-batch.

Uneven shares: every rank runs the plan's number of micro-steps, except that an empty micro-batch (only
with train.micro_batch_size=1 on uneven shares) is skipped. That keeps the collectives in step: DDP
communicates in a rank's first forward of a step (buffer broadcast, the one-time bucket rebuild) and in
its synchronised backward, and the last micro-batch is never empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchlaunch.core.sampler import BatchPlan


def backward_share(
    net: nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    plan: BatchPlan,
    scaler: torch.amp.GradScaler,
    autocast: Callable[[], contextlib.AbstractContextManager],
    leave: Callable[[], bool] | None = None,
    sync_last: bool = True,
    completing: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Accumulate this rank's weighted gradients of one step; returns sum(count * mean loss) * W / B over
    its micro-batches as a 0-d float32 device tensor, unread (the ranks' values sum to W x the global
    mean loss). `criterion` must average over the batch (CrossEntropyLoss's default reduction).

    `leave` (core/step_drop.py), asked before each micro-batch: once True the step is being dropped,
    so the micro-batches left are skipped, except the last where `sync_last` (DDP): its forward and
    backward hold the step's collectives, which the peers are waiting in; it runs on two of its samples.
    The gradients are then garbage and the caller discards them (and puts back the buffers it moved).

    `completing`, called before the last micro-batch's backward: the group may average gradients
    while that backward runs (a live group's buckets); a step left early never calls it."""
    total = torch.zeros((), device=next(net.parameters()).device)
    batches = [(x, y) for x, y in micro_batches if len(y)]
    last = len(batches) - 1
    leaving = False
    for i, (x, y) in enumerate(batches):
        leaving = leaving or (leave is not None and leave())
        if leaving and (i < last or not sync_last):
            if not sync_last:
                break
            continue  # on to the last micro-batch: the step's collectives
        if leaving:  # its collectives on two samples, at a fraction of its cost (BatchNorm needs two)
            x, y = x[:2], y[:2]
        quiet = i < last and isinstance(net, DistributedDataParallel)
        with net.no_sync() if quiet else contextlib.nullcontext():
            weight = plan.loss_weight(len(y))
            with autocast():
                loss = criterion(net(x), y)
                # 1/k exactly when the shares are even (the plain accumulation mean, bit for bit)
                loss = loss / weight.denominator if weight.numerator == 1 else loss * float(weight)
            if i == last and completing is not None:
                completing()
            scaler.scale(loss).backward()
        total += loss.detach().float()
    return total
