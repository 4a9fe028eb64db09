"""Sums of float tensors over many parts (micro-batches) held by many ranks, with the same bits however
the parts are spread over the ranks and in whatever order they are added.

Why: float addition is not associative, so a gradient summed as (a + b) + c on one rank and a + (b + c)
over two differs in its last bits, and training makes the difference grow. Sums of integers are exact
in any order. So each tensor gets a power-of-two scale agreed before the sum (from the largest |value|
of that tensor over every part on every rank: an all-reduce MAX, itself order-independent), each part
is rounded to an integer at that scale, and the integers are summed locally and then across the ranks.
They are held in float64: the scale keeps the sum of all `parts_total` parts' magnitudes <= 2**53, so
every partial sum, in any order, is an integer float64 holds exactly. So the sum over ranks may be any
exact-sum collective (RankSum): gloo's all-reduce, or shared memory on one machine (core/shm_reduce.py).
Resolution: ~2**-50 of the tensor's largest value at G = 8 (float32 itself holds 24 bits).

Speed: every pass is a float64 pass over one flat buffer (float32 + float64 in one op is ~6x slower on
CPU than a conversion then a float64 add: measured, torch 2.14), and the maxima come from aminmax
(~5x faster than an inf-norm).

ROUNDING: a float32 part is scaled and rounded in float32, then widened (half the bytes of the float64
passes: measured 145 -> see BENCHMARKS' exact rows). The same integers: times 2**e is exact in any
binary format (the scale keeps |x| < 2**53, far from float32's overflow; the scale itself must be a
float32, so a tensor of tiny values, whose scale is past 2**127, takes float64; a product that falls into
float32's subnormals is below 2**-126, which rounds to 0 in either format), and round-half-to-even of
the same exact value is the same integer (above 2**24 every float32 is one already).

A tensor with a non-finite value anywhere comes out all NaN on every rank (GradScaler skips the step,
the loss check stops the run), since its scale cannot be chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

EXACT_BITS = 53
"""float64 holds every integer up to 2**53: the bound on the sum of every part's magnitude."""


class RankSum(Protocol):
    """The sum over ranks of one float64 buffer per rank (exact whatever the order: integers)."""

    def target(self, numel: int, device: torch.device) -> torch.Tensor:
        """The float64 buffer (`numel` long) this rank writes its own sum into."""
        ...

    def total(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local` (target()'s buffer) summed; a buffer the caller may change until the next call."""
        ...


class LocalSum:
    """One rank, or ranks that sum over gloo/NCCL's all-reduce; the buffer is kept between steps."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self._buffer: torch.Tensor | None = None

    def target(self, numel: int, device: torch.device) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() != numel or self._buffer.device != device:
            self._buffer = torch.empty(numel, dtype=torch.float64, device=device)
        return self._buffer

    def total(self, local: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(local, op=dist.ReduceOp.SUM)
        return local


def local_max(parts: Sequence[Sequence[torch.Tensor]], count: int, device: torch.device) -> torch.Tensor:
    """Per tensor index, the largest |value| over this rank's parts (float32, `count` long); +inf where
    any value is not finite (NaN would make a MAX all-reduce depend on the order it met it)."""
    out = torch.zeros(count, dtype=torch.float32, device=device)
    for tensors in parts:
        out = torch.maximum(out, torch.stack([_abs_max(t) for t in tensors]))
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-d float32 (NaN if t holds one): one pass."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t)
    return torch.maximum(high, -low).float()


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
    ranks: RankSum,
    scratch: torch.Tensor | None = None,
    consume: bool = False,
) -> list[torch.Tensor]:
    """The mean over all `parts_total` parts (this rank's `parts` and every other rank's) of each tensor,
    in the dtype and shape of `like`, the same bits on every rank and for every spread of the parts.
    `maxima` must be agree_max's result (the same on every rank). `scratch`: a float64 buffer at least
    as long as `like` together, for this rank's second and later parts (else one is made). `consume`: the
    parts' float32 tensors may be scaled in place (the caller lets them go after)."""
    exps = exponents(maxima, parts_total)
    sizes = [t.numel() for t in like]
    device = like[0].device if like else torch.device("cpu")
    flat = ranks.target(sum(sizes), device)
    finite = [k for k, e in enumerate(exps) if e is not None]
    scales = [math.ldexp(1.0, exps[k]) for k in finite]  # type: ignore[arg-type]
    if len(finite) < len(exps) or not parts:
        flat.zero_()  # a rank with no part adds 0; a tensor without a scale is NaN below
    narrow = all(-126 <= exps[k] <= 127 for k in finite)  # type: ignore[operator]  # scales float32 holds
    if parts:
        if len(parts) > 1 and (scratch is None or scratch.numel() < flat.numel()):
            scratch = torch.empty_like(flat)
        for j, tensors in enumerate(parts):
            into = flat if j == 0 else scratch[: flat.numel()]  # type: ignore[index]
            views = _views(into, sizes, like, finite)
            picked = [tensors[k] for k in finite]
            if narrow and all(t.dtype == torch.float32 for t in picked):  # in float32: see ROUNDING
                scaled = picked if consume else torch._foreach_mul(picked, scales)
                if consume:
                    torch._foreach_mul_(scaled, scales)
                torch._foreach_round_(scaled)
                torch._foreach_copy_(views, scaled)
            else:  # float64: the product is exact, round() lands on the integer
                torch._foreach_copy_(views, picked)
                torch._foreach_mul_(views, scales)
                torch._foreach_round_(views)
            if j:
                flat.add_(into)
    sums = _views(ranks.total(flat), sizes, like, range(len(like)))
    back = [math.ldexp(1.0, -e) for e in (exps[k] for k in finite)]  # type: ignore[operator]
    power_of_two = parts_total & (parts_total - 1) == 0
    if power_of_two:  # (s * 2**-e) / G is one exact product
        back = [b / parts_total for b in back]
    picked = [sums[k] for k in finite]
    torch._foreach_mul_(picked, back)
    if not power_of_two:
        torch._foreach_div_(picked, float(parts_total))
    return [
        sums[k].to(t.dtype, copy=True) if exps[k] is not None else torch.full_like(t, math.nan)
        for k, t in enumerate(like)
    ]


def _views(
    flat: torch.Tensor, sizes: list[int], like: Sequence[torch.Tensor], keep: Sequence[int]
) -> list[torch.Tensor]:
    pieces = flat.split(sizes)
    return [pieces[k].view(like[k].shape) for k in keep]
