"""Sums of float tensors over many parts (micro-batches) held by many ranks, with the same bits however
the parts are spread over the ranks and in whatever order they are added.

Why: float addition is not associative, so a gradient summed as (a + b) + c on one rank and a + (b + c)
over two differs in its last bits, and training makes the difference grow. Integer addition is
associative. So each tensor gets a power-of-two scale agreed before the sum (from the largest |value|
of that tensor over every part on every rank: an all-reduce MAX, itself order-independent), each part
is rounded to int64 at that scale, the int64 parts are summed locally and then across the ranks
(all-reduce SUM on int64), and the sum is scaled back. The scale leaves the sum of `parts_total` parts
below 2**62, and resolves each value to ~2**-59 of its tensor's largest: finer than float32 itself.

A tensor with a non-finite value anywhere comes out all NaN on every rank (GradScaler skips the step,
the loss check stops the run), since its scale cannot be chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

HEADROOM_BITS = 62
"""The sum of every part's magnitude stays below 2**62 (int64 holds 2**63 - 1; rounding adds <= 1/2 a part)."""


def local_max(parts: Sequence[Sequence[torch.Tensor]], count: int, device: torch.device) -> torch.Tensor:
    """Per tensor index, the largest |value| over this rank's parts (float32, `count` long); +inf where
    any value is not finite (NaN would make a MAX all-reduce depend on the order it met it)."""
    out = torch.zeros(count, dtype=torch.float32, device=device)
    for tensors in parts:
        norms = torch._foreach_norm([t.float() for t in tensors], math.inf)
        out = torch.maximum(out, torch.stack(norms).float())
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def agree_max(local: torch.Tensor, distributed: bool) -> torch.Tensor:
    """Every rank's per-tensor maxima, combined (MAX is exact in any order)."""
    if distributed:
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local


def exponents(maxima: torch.Tensor, parts_total: int) -> list[int | None]:
    """Per tensor, e such that parts_total parts of magnitude <= max, times 2**e, stay below 2**62;
    None for a non-finite max."""
    spare = math.ceil(math.log2(parts_total)) if parts_total > 1 else 0
    out: list[int | None] = []
    for m in maxima.tolist():
        if not math.isfinite(m):
            out.append(None)
            continue
        _, exp = math.frexp(m)  # m < 2**exp (exp = 0 for m = 0: any scale works)
        out.append(HEADROOM_BITS - spare - exp)
    return out


def exact_mean(
    parts: Sequence[Sequence[torch.Tensor]],
    like: Sequence[torch.Tensor],
    maxima: torch.Tensor,
    parts_total: int,
    distributed: bool,
) -> list[torch.Tensor]:
    """The mean over all `parts_total` parts (this rank's `parts` and every other rank's) of each tensor,
    in the dtype and shape of `like`, the same bits on every rank and for every spread of the parts.
    `maxima` must be agree_max's result (the same on every rank)."""
    exps = exponents(maxima, parts_total)
    sizes = [t.numel() for t in like]
    device = like[0].device if like else torch.device("cpu")
    flat = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
    views = flat.split(sizes)
    for k, e in enumerate(exps):
        if e is None:
            continue
        scale = math.ldexp(1.0, e)  # a power of two: multiplying by it is exact in float64
        for tensors in parts:
            views[k].add_(torch.round(tensors[k].reshape(-1).double() * scale).long())
    if distributed:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out = []
    for k, e in enumerate(exps):
        t = like[k]
        if e is None:
            out.append(torch.full_like(t, math.nan))
            continue
        mean = views[k].double().mul_(math.ldexp(1.0, -e)).div_(parts_total)
        out.append(mean.to(t.dtype).view_as(t))
    return out
