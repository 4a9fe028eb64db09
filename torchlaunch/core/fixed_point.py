"""Sums of float tensors over many parts (micro-batches) held by many ranks, with the same bits however
the parts are spread over the ranks and in whatever order they are added.

Why: float addition is not associative, so a gradient summed as (a + b) + c on one rank and a + (b + c)
over two differs in its last bits, and training makes the difference grow. Sums of integers are exact
in any order. So each tensor gets a power-of-two scale agreed before the sum (from the largest |value|
of that tensor over every part on every rank: an all-reduce MAX, itself order-independent), each part
is rounded to an integer at that scale, and the integers are summed locally and then across the ranks.
They are held in float64: the scale keeps the sum of all `parts_total` parts' magnitudes <= 2**53, so
every partial sum, in any order, is an integer float64 holds exactly, and gloo and NCCL sum float64.
Resolution: ~2**-50 of the tensor's largest value at G = 8 (float32 itself holds 24 bits).

A tensor with a non-finite value anywhere comes out all NaN on every rank (GradScaler skips the step,
the loss check stops the run), since its scale cannot be chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

EXACT_BITS = 53
"""float64 holds every integer up to 2**53: the bound on the sum of every part's magnitude."""
FLOAT32_SCALE = 126
"""Scales up to 2**126 are float32 numbers: multiplying a float32 by one is exact (a product below the
smallest normal rounds to 0 either way); past it (a tensor whose largest value is below ~2**-73) float64."""


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
    """Per tensor, e such that parts_total parts of magnitude <= max, times 2**e and rounded, sum to at
    most 2**53; None for a non-finite max."""
    spare = math.ceil(math.log2(parts_total)) if parts_total > 1 else 0
    out: list[int | None] = []
    for m in maxima.tolist():
        if not math.isfinite(m):
            out.append(None)
            continue
        _, exp = math.frexp(m)  # m < 2**exp (exp = 0 for m = 0: any scale works)
        out.append(EXACT_BITS - spare - exp)
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
    flat = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    sums = [v.view_as(t) for v, t in zip(flat.split(sizes), like, strict=True)]
    fast = [k for k, e in enumerate(exps) if e is not None and abs(e) <= FLOAT32_SCALE]
    wide = [k for k, e in enumerate(exps) if e is not None and abs(e) > FLOAT32_SCALE]
    scales = [math.ldexp(1.0, exps[k]) for k in fast]  # type: ignore[arg-type]
    for tensors in parts:
        if fast:  # one pass each: scale (exact), round to the integer, add into float64 (exact)
            q = torch._foreach_mul([tensors[k].float() for k in fast], scales)
            torch._foreach_round_(q)
            torch._foreach_add_([sums[k] for k in fast], q)
        for k in wide:
            sums[k].add_(torch.round(tensors[k].double() * math.ldexp(1.0, exps[k])))  # type: ignore[arg-type]
    if distributed:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out = []
    for k, e in enumerate(exps):
        t = like[k]
        if e is None:
            out.append(torch.full_like(t, math.nan))
        else:
            out.append(sums[k].mul(math.ldexp(1.0, -e)).div_(parts_total).to(t.dtype))
    return out
