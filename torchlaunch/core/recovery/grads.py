"""What DDP does for a live group, done by hand: rank 0's parameters broadcast, and gradients averaged
over one flat buffer after backward.

Why not DDP: its reducer fails inside autograd when a peer dies mid-step, and its state is then lost
with the group; a flat all-reduce after backward fails in this rank's own call, before the optimizer
step, so the step can run again unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from torchlaunch.core.shm_reduce import SharedMemoryReducer


class FlatGradients:
    """Every trainable parameter's .grad is a view into one flat buffer (what DDP's
    gradient_as_bucket_view does for its buckets): backward accumulates into it in place, the ranks
    average the buffer itself with no gather or scatter copy, and zeroing it is one fill. Each view has
    its parameter's strides (channels_last too), so autograd accumulates without a layout change.
    Every rank averages the whole buffer every step, whatever its share: a rank with no samples in a
    step, or a parameter unused in it, adds zeros rather than leaving its peers' all-reduce short."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        first = self.params[0]
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device)
        self.attach()

    @staticmethod
    def fits(params: Iterable[torch.nn.Parameter]) -> bool:
        """One dtype and device, each parameter dense (its elements tile a block of memory exactly)."""
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            return False
        kinds = {(p.dtype, p.device) for p in trainable}
        return len(kinds) == 1 and all(p.is_contiguous() or _dense(p) for p in trainable)

    def attach(self) -> None:
        """(Re)make each .grad the parameter's view of the buffer (after anything set it to None)."""
        offset = 0
        for p in self.params:
            p.grad = self.flat.as_strided(p.shape, p.stride(), offset)
            offset += p.numel()

    def zero(self) -> None:
        self.flat.zero_()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s strides are a permutation of a contiguous layout's (channels_last is)."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in order:
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def average_gradients(grads: FlatGradients, world_size: int, reducer: SharedMemoryReducer | None = None) -> None:
    """The mean of every rank's gradients, in place, on the flat buffer: through shared memory when the
    ranks share a machine (`reducer`; its barrier is a gloo collective, so a lost peer fails it the
    same way), else one gloo all-reduce (sum) then / world_size. Either way the result is bit-identical
    on every rank (a/2 + b/2 == (a + b)/2 for two ranks; rank order above). Why shared memory: a gloo
    all-reduce of even a few KB costs ~1.5-2 ms on loopback here, its 1-float barrier ~0.25 ms."""
    if world_size == 1:
        return
    if reducer is not None:
        reducer.average_flat(grads.flat)
    else:
        dist.all_reduce(grads.flat)
        grads.flat.div_(world_size)


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (what DDP does when it is built)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)
