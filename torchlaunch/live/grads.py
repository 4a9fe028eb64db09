"""What DDP does for a live group, done by hand: rank 0's parameters broadcast, and gradients averaged
over one flat buffer, in buckets posted from backward's gradient hooks as DDP does.

Why not DDP: its reducer fails inside autograd when a peer dies mid-step, and its state is then lost
with the group. Here a bucket's all-reduce is only posted in backward; a failed one is raised when the
step waits for them all after backward, in this rank's own call before the optimizer step, so the step
can run again unchanged (OverlappedGradients).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
"""DDP's bucket sizes (its first bucket small, so communication starts early in backward)."""


class OverlappedGradients(FlatGradients):
    """The flat buffer cut into buckets that are all-reduced while backward still runs, as DDP's
    reducer does: parameters lie in the buffer in reverse order (backward's order, roughly), each bucket
    a contiguous slice, and a parameter's post-accumulate hook marks it done. Buckets are posted
    strictly in their order, so every rank posts the same collectives in the same order whatever its
    own backward's order (a parameter unused on one rank holds its bucket, and those after it, until
    finish()). Only the backward armed by arm() posts (the last micro-batch of a step); finish() posts
    what is left, waits, and raises a peer's loss there, never inside autograd."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        trainable = [p for p in params if p.requires_grad]
        super().__init__(list(reversed(trainable)))
        self.buckets, self._bucket_of = _cut(self.params, first_bucket_bytes, bucket_bytes)
        self._sizes = [0] * len(self.buckets)
        for b in self._bucket_of:
            self._sizes[b] += 1
        self._armed = False
        self._left: list[int] = []
        self._ready: list[bool] = []
        self._next = 0
        self._works: list[dist.Work] = []
        self._error: BaseException | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._accumulated(i))
            for i, p in enumerate(self.params)
        ]

    def arm(self) -> None:
        """The next backward completes this step's gradients: post each bucket as its parameters are in."""
        self.discard()
        self._armed, self._left, self._ready = True, list(self._sizes), [False] * len(self.buckets)

    def _accumulated(self, index: int) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[index]
        self._left[bucket] -= 1
        if self._left[bucket] == 0:
            self._ready[bucket] = True
            while self._next < len(self.buckets) and self._ready[self._next]:
                self._post(self._next)

    def _post(self, bucket: int) -> None:
        self._next = bucket + 1
        if self._error is not None:
            return
        try:
            self._works.append(dist.all_reduce(self.flat[self.buckets[bucket]], async_op=True))
        except Exception as e:  # a broken group: raised by finish(), outside autograd
            self._error = e

    def finish(self, world_size: int) -> None:
        """The mean of every rank's gradients: the buckets backward did not post (all of them when no
        backward was armed: a step left early, a rank with no samples), in order, then every wait."""
        self._armed = False
        for bucket in range(self._next, len(self.buckets)):
            self._post(bucket)
        try:
            for work in self._works:
                work.wait()
            if self._error is not None:
                raise self._error
        finally:
            self.discard()
        self.flat.div_(world_size)

    def discard(self) -> None:
        """Forget the step's collectives: a failed one's references would keep its broken group's
        connections open (worker/groups/live.loss_line)."""
        self._armed, self._next, self._works, self._error = False, 0, [], None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.discard()


def _cut(params: Sequence[torch.nn.Parameter], first_bytes: int, cap_bytes: int) -> tuple[list[slice], list[int]]:
    """Contiguous buckets over the flat buffer (parameters in its order), cut at parameter boundaries
    once a bucket reaches its size; and each parameter's bucket."""
    buckets: list[slice] = []
    bucket_of: list[int] = []
    start = offset = size = 0
    for p in params:
        bucket_of.append(len(buckets))
        offset += p.numel()
        size += p.numel() * p.element_size()
        if size >= (first_bytes if not buckets else cap_bytes):
            buckets.append(slice(start, offset))
            start, size = offset, 0
    if start < offset:
        buckets.append(slice(start, offset))
    return buckets, bucket_of


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
