"""Gradient averaging through shared memory for DDP jobs whose ranks all run on one CPU machine.

Why: gloo averages gradients over TCP loopback, a ring of kernel copies that burns the same cores
the ranks train on. When every rank is on one machine the gradients can meet in /dev/shm instead:
each rank copies its bucket into its own slot, one tiny gloo all-reduce serves as a barrier, and every
rank sums the slots itself. Measured in bench/ddp.py (2 ranks x 1 thread, fastnet): copy + sum
~1.2 ms per step against gloo's ~10 ms.

Exactness: every rank sums the slots in rank order and divides by the world size, which is exactly
what `torchlaunch.core.dist.ordered_allreduce_hook` computes (and, for two ranks, what DDP's default hook computes:
a/2 + b/2 == (a + b)/2 in binary floating point). So results do not depend on bucket layout, and
switching this path on or off changes no bit of a run.

Slots are double-buffered by call parity: a rank writes call k+2's slot only after call k+1's
barrier, which every rank passes only after it finished reading call k. One barrier per bucket.
The file is unlinked as soon as every rank has mapped it: nothing is left in /dev/shm, even after a
crash. Any problem while setting up (no /dev/shm, too little space, a rank that cannot see rank 0's
file) leaves every rank on gloo's own all-reduce, decided together.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from torchlaunch.core.dist import rank_order_mean

SHM_DIR = "/dev/shm"
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's default bucket_cap_mb


def slot_bytes(model: nn.Module, bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES) -> int:
    """Bytes one rank's slot needs: the largest bucket DDP builds after its first step (a bucket
    closes once it passes the cap, so up to the cap plus one parameter), never more than all
    trainable parameters together; rounded up to 64 bytes so that every slot starts aligned for any
    dtype and ranks never share a cache line. (DDP's very first step may use one bucket for the whole
    model; a bucket larger than the slot goes through gloo, in the same rank order.)"""
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    if not sizes:
        return 0
    need = min(sum(sizes), bucket_cap_bytes + max(sizes))
    return -(-need // 64) * 64


@dataclass
class SharedMemoryReducer:
    """State of the comm hook: this rank's view of the shared slots."""

    rank: int
    world_size: int
    slots: torch.Tensor  # uint8 [2, world, slot bytes]
    group: object = None
    calls: int = 0
    gloo_fallbacks: int = 0
    barrier_flag: torch.Tensor = field(default_factory=lambda: torch.zeros(1))

    def average(self, grads: torch.Tensor) -> torch.Tensor:
        """Replace `grads` (this rank's flat bucket) with the rank-order mean over all ranks."""
        nbytes = grads.numel() * grads.element_size()
        if nbytes > self.slots.shape[2]:  # the same on every rank: DDP agrees on bucket layout
            self.gloo_fallbacks += 1
            return _ordered_gloo_average(grads, self.world_size, self.group)
        parity = self.calls % 2
        self.calls += 1
        views = [self.slots[parity, r, :nbytes].view(grads.dtype) for r in range(self.world_size)]
        flat = grads.view(-1)
        if self.world_size == 2:  # halve on the way in, one fused add: a/2 + b/2, DDP's own formula
            torch.div(flat, 2, out=views[self.rank])
            dist.all_reduce(self.barrier_flag, group=self.group)  # every rank's slot is written
            torch.add(views[0], views[1], out=flat)
        else:
            views[self.rank].copy_(flat)
            dist.all_reduce(self.barrier_flag, group=self.group)
            rank_order_mean(views, out=flat)
        return grads

    def average_flat(self, flat: torch.Tensor) -> None:
        """`average` over a flat buffer of any size, slot-sized piece by piece (one barrier each)."""
        per_slot = max(1, self.slots.shape[2] // flat.element_size())
        for piece in flat.split(per_slot):
            self.average(piece)


def _ordered_gloo_average(grads: torch.Tensor, world_size: int, group: object) -> torch.Tensor:
    gathered = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(gathered, grads, group=group)
    return rank_order_mean(gathered, out=grads)


def shared_memory_hook(state: SharedMemoryReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook (synchronous: the future is complete when it returns)."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(state.average(bucket.buffer()))
    return done


# DDP validates the hook's annotations as real objects (this module uses postponed annotations).
shared_memory_hook.__annotations__ = {
    "state": SharedMemoryReducer,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _map_slots(path: str, world_size: int, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=2 * world_size * nbytes, dtype=torch.uint8).view(
        2, world_size, nbytes
    )


def _broadcast_path(path: str | None) -> str | None:
    """Rank 0's shared-memory file name on every rank, as bounded JSON (never a pickle: a peer of a live
    group is checked the same way as every other value it sends)."""
    from torchlaunch.core.dist import DistContext, broadcast_json

    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend())
    return broadcast_json(ctx, path, kinds=(str, type(None)), max_bytes=4096)  # type: ignore[return-value]


SLOT_NAME = re.compile(r"ddp-grads-[0-9]{1,10}-[0-9a-f]{12}", re.ASCII)


def _made_here(path: str, shm_dir: str) -> bool:
    """Whether `path` is a name build_reducer's rank 0 makes in `shm_dir` (and nothing else to map)."""
    return os.path.dirname(path) == os.path.normpath(shm_dir) and bool(SLOT_NAME.fullmatch(os.path.basename(path)))


def build_reducer(
    model: nn.Module,
    shm_dir: str = SHM_DIR,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    nbytes: int | None = None,
) -> SharedMemoryReducer | None:
    """Collective over the default group: every rank returns a reducer, or every rank returns None
    (then the caller keeps gloo). Call only when every rank runs on this machine. `nbytes`: a slot's
    size (else slot_bytes's for DDP's buckets)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = slot_bytes(model, bucket_cap_bytes) if nbytes is None else -(-nbytes // 64) * 64
    path, error = None, ""
    if rank == 0:
        path = os.path.join(shm_dir, f"ddp-grads-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:  # reserve the pages now: a full tmpfs fails here, not with SIGBUS mid-step
                os.posix_fallocate(fd, 0, 2 * world * nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    path = _broadcast_path(path if not error else None)
    if path is not None and not _made_here(path, shm_dir):
        path = None  # only a file rank 0 makes here is mapped: anything else is this rank giving up on it
    slots = None
    if path is not None and nbytes > 0:
        try:
            slots = _map_slots(path, world, nbytes)
        except (OSError, RuntimeError):
            slots = None
    failed = torch.tensor([0.0 if slots is not None else 1.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # everyone has mapped it (or given up) past here
    if rank == 0 and path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
    if failed.item() or slots is None:
        return None
    return SharedMemoryReducer(rank=rank, world_size=world, slots=slots)


class SharedSum:
    """train.exact's sum over ranks (core/fixed_point.RankSum) when every rank is on this machine: each
    rank rounds its parts straight into its own slot, one tiny gloo all-reduce is the barrier, and every
    rank adds the slots. The slots hold fixed-point integers, so any order gives the same bits as gloo's
    all-reduce: a run may move between one machine and several without a bit changing. Double-buffered
    by call parity as SharedMemoryReducer.average is."""

    def __init__(self, reducer: SharedMemoryReducer) -> None:
        self.reducer = reducer
        self._out: torch.Tensor | None = None

    def target(self, numel: int, device: torch.device) -> torch.Tensor:
        r = self.reducer
        return r.slots[r.calls % 2, r.rank, : numel * 8].view(torch.float64)

    def total(self, local: torch.Tensor) -> torch.Tensor:
        r = self.reducer
        parity, nbytes = r.calls % 2, local.numel() * 8
        r.calls += 1
        dist.all_reduce(r.barrier_flag, group=r.group)  # every rank's slot is written
        views = [r.slots[parity, k, :nbytes].view(torch.float64) for k in range(r.world_size)]
        if self._out is None or self._out.numel() != local.numel():
            self._out = torch.empty_like(local)
        torch.add(views[0], views[1], out=self._out)
        for view in views[2:]:
            self._out.add_(view)
        return self._out


def build_shared_sum(model: nn.Module, shm_dir: str = SHM_DIR) -> SharedSum | None:
    """Collective like build_reducer: slots for the float64 sums of the model's trainable parameters and
    floating buffers (worker/grid.py's parts), or None on every rank (then gloo's all-reduce)."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    numel += sum(b.numel() for b in model.buffers() if b.is_floating_point())
    reducer = build_reducer(model, shm_dir, nbytes=max(8, numel * 8))
    return SharedSum(reducer) if reducer is not None else None
