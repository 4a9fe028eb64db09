"""torchrun's group as the launcher formed it: the same ranks from start to end.

Gradients are averaged by DDP inside backward (through shared memory on one machine, in rank order
above two ranks), or by the exact grid's own sums (train.exact), or not at all on one rank. A lost
peer's error is the run's: the launcher restarts the ranks, which resume from the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchlaunch.core.dist import ordered_allreduce_hook
from torchlaunch.core.shm_reduce import SharedSum, build_reducer, build_shared_sum, shared_memory_hook
from torchlaunch.worker.grid import broadcast_model

if TYPE_CHECKING:
    from torchlaunch.config import RunConfig
    from torchlaunch.core.dist import DistContext
    from torchlaunch.live.minimum import BelowMinimum
    from torchlaunch.worker.groups import Host
    from torchlaunch.worker.metrics import RunLog

T = TypeVar("T")


class FixedGroup:
    """The launcher's group, never re-formed: every hook of the seam that a re-formed group needs is
    a no-op here, and a peer's loss is raised as it came."""

    joining = False
    joined: dict[str, Any] | None = None
    started_as: int | None = None
    reduces_in_backward = True
    keeps_grad_views = False
    generation: int | None = None
    grid_sum: SharedSum | None = None

    def form(self, host: Host) -> tuple[nn.Module, str]:
        ctx, model = host.ctx, host.model
        if ctx.distributed and host.grid:  # no DDP: the grid sums its gradients itself
            broadcast_model(model)
            self.grid_sum = self._grid_shared_sum(host)
            how = "shared memory" if self.grid_sum is not None else "all-reduce"
            return model, f"exact grid, {host.grid} x {host.plan.micro} samples, fixed-point {how}"
        if not ctx.distributed:
            return model, "local"
        net = DistributedDataParallel(
            model,
            device_ids=[host.device.index] if host.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        return net, self._gradient_path(host, net)

    @staticmethod
    def _grid_shared_sum(host: Host) -> SharedSum | None:
        """train.exact's sum over ranks through shared memory when every rank is on this CPU machine
        (the same bits as gloo's all-reduce, core/shm_reduce.SharedSum); decided together."""
        ctx = host.ctx
        local = host.device.type == "cpu" and 1 < ctx.world_size == ctx.local_world_size
        if not (host.cfg.dist.shared_memory_reduce and ctx.backend == "gloo" and local):
            return None
        return build_shared_sum(host.model)

    @staticmethod
    def _gradient_path(host: Host, net: DistributedDataParallel) -> str:
        """How DDP averages gradients. gloo on one machine: through shared memory (core/shm_reduce.py);
        gloo across machines: its all-reduce, in rank order above two ranks (bit-exact resume at any
        world size); NCCL: its own all-reduce. Every rank decides together (a collective)."""
        ctx = host.ctx
        if ctx.backend != "gloo":
            return ctx.backend or "local"
        if host.cfg.dist.shared_memory_reduce and 1 < ctx.world_size == ctx.local_world_size:
            reducer = build_reducer(host.model)
            if reducer is not None:
                net.register_comm_hook(reducer, shared_memory_hook)
                return "shared memory"
        if ctx.world_size > 2:  # two ranks sum a+b in any order: already exact
            net.register_comm_hook(None, ordered_allreduce_hook)
            return "gloo, rank order"
        return "gloo"

    def start(self, host: Host) -> Path | None:
        return host.resume()

    def opened(self, log: RunLog) -> None:
        pass

    def completing_backward(self, world_size: int) -> None:
        pass  # DDP posts its own buckets in its synchronised backward

    def reduce_gradients(self, world_size: int) -> None:
        pass  # DDP averaged them in backward; the grid sums its own

    def zero_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def fence_commit(self) -> Callable[[], AbstractContextManager[None]] | None:
        return None

    def lost(self, error: BaseException) -> str | None:
        return None

    def surviving(self, host: Host, log: RunLog, during: str, attempt: Callable[[], T]) -> T:
        return attempt()

    def recover_step(self, host: Host, log: RunLog, why: str, window: Any) -> None:
        raise RuntimeError("a fixed group does not regroup (lost() named no loss)")

    def asks_to_join(self) -> bool:
        return False

    def admit(self, host: Host, log: RunLog, window: Any) -> None:
        raise RuntimeError("a fixed group admits no rank (asks_to_join() is False)")

    def stepped(self, log: RunLog, step: int) -> None:
        pass

    def finish(self, host: Host, log: RunLog) -> None:
        host._publish_final_model(log)

    def below_minimum(self, host: Host, log: RunLog, below: BelowMinimum) -> int:
        raise below  # only a group that shrinks falls below its minimum

    def close(self) -> None:
        pass


def form(cfg: RunConfig, ctx: DistContext, attempt: int = 0) -> FixedGroup:
    """The restart road's group (torchlaunch.roads, "restart": Road.group): the launcher's, as it formed it."""
    return FixedGroup()
