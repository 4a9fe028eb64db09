"""The exact grid (train.exact): one global step's gradients and BatchNorm statistics with the same bits
on any world size, whichever rank computed which micro-batch and whatever happened to the ranks.

- Each step is G micro-batches of B/G fixed samples (core/sampler.py BatchPlan.grid); rank r of W
  computes a contiguous run of them (uneven counts are fine: there is no DDP, nothing to keep in step).
- Each micro-batch starts from the step's BatchNorm buffers and draws its random numbers (dropout) from
  a generator seeded by (seed, step, micro-batch id), so its gradient and the buffers it leaves do not
  depend on which micro-batches ran before it on that rank.
- The step's gradient is the mean of the G micro-batch gradients, the new buffers the mean of the G
  buffer states (what the momentum update gives from the mean of the batch statistics), both summed in
  fixed point (core/fixed_point.py: integers in float64), so the sum's order does not matter (across ranks:
  through shared memory on one machine, core/shm_reduce.SharedSum, else gloo). Integer buffers
  (num_batches_tracked) move once per step, as each micro-batch moved them from the same start.
- On CPU the intra-op thread count is pinned to 1 (pin_threads): a convolution's weight gradient is
  summed over the batch in per-thread pieces, so its bits depend on the thread count (measured: torch
  2.14 CPU, with and without oneDNN), and ranks get different counts at different world sizes.

Memory: a rank holds the gradients of each of its micro-batches until the step's sum (ceil(G/W) x the
parameters in float32), plus their buffers, and two float64 buffers of the parameters' size for the sums.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from torchlaunch.core import fixed_point
from torchlaunch.core.grid_cut import grid_size
from torchlaunch.core.sampler import mix_seed

__all__ = ["GridStep", "broadcast_model", "grid_size", "pin_threads"]


def pin_threads(device: torch.device) -> None:
    """One intra-op thread on CPU (see the module's docstring); nothing on an accelerator."""
    if device.type == "cpu":
        torch.set_num_threads(1)


class GridStep:
    """One rank's part of a grid step: compute its micro-batches, then agree and sum with the others.

    run() computes; agree() is the step's first collective (a step drop is decided after it:
    core/step_drop.py); finish() sums and writes the gradients into .grad and the buffers in place."""

    def __init__(
        self,
        model: nn.Module,
        grid: int,
        seed: int,
        distributed: bool,
        keep_grads: bool = False,
        shared: fixed_point.RankSum | None = None,
    ) -> None:
        """`keep_grads`: .grad tensors are views the caller keeps (live mode's flat buffer): copy and zero
        them instead of taking them. `shared`: the sum over ranks through shared memory (one machine),
        else gloo's all-reduce while `distributed`."""
        self.model, self.grid, self.seed, self.distributed, self.keep_grads = model, grid, seed, distributed, keep_grads
        self.shared = shared
        self._local = fixed_point.LocalSum(distributed)
        self._scratch: torch.Tensor | None = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        buffers = list(model.buffers())
        self.floats = [b for b in buffers if b.is_floating_point()]
        self.others = [b for b in buffers if not b.is_floating_point()]
        self._start: list[torch.Tensor] = []
        self._ends: list[torch.Tensor] = []
        """Integer buffers (num_batches_tracked) as every micro-batch left them: the same from the same start."""
        self._parts: list[list[torch.Tensor]] = []
        self._maxima: torch.Tensor | None = None
        self._seconds = 0.0
        self.paces: list[float] = []
        """After agree(): every rank's seconds per micro-batch of this step (0 where a rank timed none),
        the same list on every rank (worker/balance.py reads it)."""

    def run(
        self,
        micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        first_id: int,
        step: int,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scale: Callable[[torch.Tensor], torch.Tensor],
        autocast: Callable[[], contextlib.AbstractContextManager],
        leave: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of each micro-batch (ids first_id, first_id + 1, ...) of global step `step`
        (`scale`: GradScaler.scale); returns the sum of their mean losses (0-d float32, unread). Stops
        before the next micro-batch once `leave()` (core/step_drop.py)."""
        device = self.params[0].device
        self._start = [b.detach().clone() for b in (*self.floats, *self.others)]
        self._parts = []
        total = torch.zeros((), device=device)
        devices = [device] if device.type == "cuda" else []
        started = time.perf_counter()
        for j, (x, y) in enumerate(micro_batches):
            if leave is not None and leave():
                break
            self._restore_buffers()
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(mix_seed(self.seed, step, first_id + j, 5))
                with autocast():
                    loss = criterion(self.model(x), y)
                scale(loss).backward()
            self._parts.append([*self._take_grads(), *(b.detach().clone() for b in self.floats)])
            total += loss.detach().float()
        if self._parts and device.type == "cuda":  # the pace is the device's work, not the queueing
            torch.cuda.synchronize(device)
        self._seconds = (time.perf_counter() - started) / len(self._parts) if self._parts else 0.0
        self._ends = [b.detach().clone() for b in self.others] if self._parts else []
        self._restore_buffers()  # until finish(): a step dropped or lost in a collective left them untouched
        return total

    def agree(self, rank: int = 0, world: int = 1) -> None:
        """The per-tensor maxima of every rank (a collective every rank joins, even one that left), and in
        the same MAX every rank's pace (a slot per rank, 0 in the others' slots)."""
        like = self._like()
        local = fixed_point.local_max(self._parts, len(like), like[0].device)
        paces = torch.zeros(world, dtype=local.dtype, device=local.device)
        paces[rank] = self._seconds
        both = fixed_point.agree_max(torch.cat([local, paces]), self.distributed)
        self._maxima, self.paces = both[: len(like)], both[len(like) :].tolist()

    def finish(self) -> None:
        """The step's gradients (mean over the grid) into .grad, and its buffers, the same bits on every rank."""
        assert self._maxima is not None
        like = self._like()
        self._local.distributed = self.distributed  # live mode: the group re-formed, of any size
        numel = sum(t.numel() for t in like)
        if len(self._parts) > 1 and (self._scratch is None or self._scratch.numel() < numel):
            self._scratch = torch.empty(numel, dtype=torch.float64, device=like[0].device)
        ranks = self.shared if self.shared is not None and self.distributed else self._local
        means = fixed_point.exact_mean(self._parts, like, self._maxima, self.grid, ranks, self._scratch, consume=True)
        self._parts, self._maxima = [], None
        n = len(self.params)
        with torch.no_grad():
            for p, g in zip(self.params, means[:n], strict=True):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)
            for b, v in zip(self.floats, means[n:], strict=True):
                b.copy_(v)
            for b, v in zip(self.others, self._ends, strict=False):  # none where no micro-batch ran here
                b.copy_(v)
        self._ends = []

    def discard(self) -> None:
        """A dropped step: its parts are let go (the buffers are already the step's start)."""
        self._parts, self._maxima, self._ends = [], None, []

    def _like(self) -> list[torch.Tensor]:
        return [*self.params, *self.floats]

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for b, v in zip((*self.floats, *self.others), self._start, strict=True):
                b.copy_(v)

    def _take_grads(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            g = p.grad
            if g is None:
                out.append(torch.zeros_like(p))
            elif self.keep_grads:
                out.append(g.detach().clone())
                g.zero_()
            else:
                out.append(g.detach())
                p.grad = None
        return out


def broadcast_model(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (what DDP does when it is built; the grid has no DDP)."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
