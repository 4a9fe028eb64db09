"""Process-group setup from the launcher -> worker environment contract (read by torchlaunch.contract).

When the contract is absent the worker runs as a single process without a process group, so
`python -m train` works on a laptop exactly like under torchrun, submitit or Kubernetes.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchlaunch import compat
from torchlaunch.base.untrusted import load_json, quote
from torchlaunch.contract import live_first_group, read_env
from torchlaunch.core.affinity import pin_local_rank
from torchlaunch.exit_codes import BadInput, ConfigError


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job, and where it computes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is usable, else CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise BadInput(
                f"env error: LOCAL_RANK={local_rank} but only {count} GPU(s) are visible "
                "(start at most one worker per GPU, or check CUDA_VISIBLE_DEVICES)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


START_WAIT_S = 300.0
"""How long a rank waits for every rank of its group to arrive (connecting to the store, the group's
first handshake), whatever dist.timeout_s is. Ranks of several nodes start seconds to minutes apart
(imports from a shared filesystem, a busier node): that is a slow start, not a lost peer, and with a
short dist.timeout_s it ended the job before its first step. dist.timeout_s bounds every collective
after the group is formed."""


def setup(timeout_s: float = 300.0, backend: str = "auto", pin_cpus: bool = False, alone: bool = False) -> DistContext:
    """Join the process group described by the environment (or run alone). `pin_cpus`: CPU workers
    sharing a machine each take their own slice of cores first (torchlaunch.core.affinity), so that the
    threads gloo and OpenMP start later inherit it. `alone`: a rank started again in live mode takes its
    device and cores but forms no group here (it joins the live group later)."""
    env = read_env()
    first = live_first_group() if env is not None else None
    if env is not None and alone:
        local_rank = int(env["LOCAL_RANK"])
        device = pick_device(local_rank)
        if pin_cpus and device.type == "cpu":
            pin_local_rank(local_rank, int(env["LOCAL_WORLD_SIZE"]))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistContext(
            rank=0, world_size=1, local_rank=local_rank, local_world_size=int(env["LOCAL_WORLD_SIZE"]), device=device
        )
    if env is None or (first is None and int(env["WORLD_SIZE"]) == 1):  # one rank (launch.local --gpus 1): no group
        device = pick_device(0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistContext(device=device)
    local_rank = int(env["LOCAL_RANK"])
    device = pick_device(local_rank)
    if pin_cpus and device.type == "cpu":
        pin_local_rank(local_rank, int(env["LOCAL_WORLD_SIZE"]))
    chosen = backend if backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if chosen == "nccl" and device.type != "cuda":
        raise ConfigError("dist.backend", "nccl needs CUDA GPUs", "use dist.backend=gloo or auto on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # launch.local --nnodes MIN:MAX in live mode: the first group is the nodes that came in time, its
    # ranks numbered apart from the launch's RANK (contract.LIVE_FIRST_GROUP)
    rank, world = first or (int(env["RANK"]), int(env["WORLD_SIZE"]))
    dist.init_process_group(
        backend=chosen,
        init_method="env://",  # reuses torchrun's store when it shares one, else rank 0 hosts it
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(timeout_s, START_WAIT_S)),
        device_id=device if device.type == "cuda" else None,
    )
    if timeout_s < START_WAIT_S:
        compat.set_group_timeout(timeout_s)  # every collective from here on: dist.timeout_s
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=int(env["LOCAL_WORLD_SIZE"]),
        device=device,
        backend=chosen,
    )


def teardown(ctx: DistContext, clean: bool = True) -> None:
    """Leave the process group. A barrier first: without it one rank sometimes aborts at exit on
    torch 2.14.1 ("terminate called without an active exception"). Skipped after a failure and on
    bad input, where a peer may be gone, or may never come (bad input found by this rank alone, while
    its peers sit in their next collective): the barrier would only hang until the process-group
    timeout. No collective has a per-call bound that works on every rank (gloo's monitored barrier
    waits the full timeout on the ranks other than 0), so the rank leaves and the launcher stops
    the rest of the group."""
    if not ctx.distributed or not dist.is_initialized():
        return
    store = None
    if clean:
        try:
            closing_barrier(ctx)
            store = compat.default_store()
        except Exception:  # a peer already left: nothing to synchronise with
            pass
    try:
        dist.destroy_process_group()
    except Exception:  # a peer's store is gone: leaving is all that is left to do
        pass
    if store is not None:
        leave_after_peers(store, ctx.rank, ctx.world_size)


HELD_TO_THE_END: list[Any] = []
"""The closing barrier's handle, held until the process ends (see closing_barrier)."""


def closing_barrier(ctx: DistContext) -> None:
    """The barrier before leaving, its handle kept for the rest of the process. gloo's barrier holds
    the collectives still in flight when it was posted (a checkpoint's gather, say) and
    they are freed with it. Freed on gloo's worker thread, a tensor Python made needs the GIL: when
    that thread is scheduled only after the interpreter has started finalising (a program that ends
    right after, on a loaded machine), taking the GIL ends the thread and the process aborts
    ("terminate called without an active exception", SIGABRT after a clean finish: 3 runs in ~70 of
    examples/custom_loop.py under torchrun here; core dump: ~AsyncBarrierWork -> ~AsyncAllgatherWork
    -> decref_pyobject -> take_gil, pytorch#190489). Held here, they are freed by the main thread at
    exit, never by gloo's."""
    work = barrier(ctx)
    if work is not None:
        HELD_TO_THE_END.append(work)


LEAVE_TIMEOUT_S = 30.0
"""How long the store's host waits for its peers to have left their process group."""


def leave_after_peers(store: Any, rank: int, world_size: int) -> None:
    """The rank that hosts the TCPStore (rank 0 under launch.local, where TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    gives every group its own store) leaves last. When it exited first, a peer still inside
    destroy_process_group lost the store under a C++ thread, which aborted the process ("terminate called
    without an active exception", exit 1 after a clean finish). Every peer says it has left; the host
    waits for all of them (bounded: a peer that died is not waited for)."""
    try:
        if rank != 0:
            store.set(f"torchlaunch/left/{rank}", "1")
            return
        store.wait([f"torchlaunch/left/{r}" for r in range(1, world_size)], datetime.timedelta(seconds=LEAVE_TIMEOUT_S))
    except Exception:  # a peer died or the store is gone: leaving is all that is left to do
        pass


def barrier(ctx: DistContext) -> Any:
    """Wait for every rank; the finished barrier's handle (None in a single process)."""
    if not ctx.distributed:
        return None
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    work = dist.barrier(async_op=True, device_ids=device_ids)
    if work is not None:
        work.wait()
    return work


def _all_reduce(ctx: DistContext, values: list[float], op: dist.ReduceOp) -> list[float]:
    if not ctx.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)  # float64: counts stay exact
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_reduce_max(ctx: DistContext, values: list[float]) -> list[float]:
    """Element-wise max over ranks of a few flags: one small collective per call."""
    return _all_reduce(ctx, values, dist.ReduceOp.MAX)


def all_reduce_sum(ctx: DistContext, values: list[float]) -> list[float]:
    """Element-wise sum over ranks (loss sums, correct counts, sample counts)."""
    return _all_reduce(ctx, values, dist.ReduceOp.SUM)


def all_reduce_sum_(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place, on its device, and return it: nothing is read on the host."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class PendingMax:
    """One posted all-reduce (max) of a flag; `result()` reads it, waiting only for that collective."""

    def __init__(self, values: torch.Tensor, work: dist.Work | None, event: torch.cuda.Event | None) -> None:
        self._values, self._work, self._event = values, work, event

    def result(self) -> bool:
        if self._work is not None:  # gloo: the collective runs on its own threads
            self._work.wait()
        if self._event is not None:  # NCCL: the flag reaches pinned host memory behind the step
            self._event.synchronize()
        return bool(self._values.numpy()[0] > 0)  # a host buffer: numpy() is a view, no device read


class FlagMax:
    """Posts all-reduce(max) of a host flag without waiting for it (StepAgreement's collective).

    gloo (any device): a one-element CPU tensor, reduced on gloo's threads. NCCL: a device copy of a
    constant 0/1 tensor is reduced on NCCL's stream, then copied to pinned host memory with an event
    behind it; the host waits for that event only, once the device has long passed it."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.nccl = ctx.backend == "nccl"
        if self.nccl:
            self._constants = {v: torch.full((1,), float(v), device=ctx.device) for v in (False, True)}

    def post(self, flag: bool) -> PendingMax:
        if not self.nccl:
            values = torch.tensor([1.0 if flag else 0.0])
            return PendingMax(values, dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True), None)
        on_device = self._constants[flag].clone()
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, async_op=True).wait()  # a stream wait, not a host one
        host = torch.empty(1, pin_memory=True)
        host.copy_(on_device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingMax(host, None, event)


def broadcast_buffers(ctx: DistContext, module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats), as the checkpoint holds them."""
    if ctx.distributed:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


MAX_JSON_BYTES = 1 << 20
"""The most a peer's JSON value may hold on the wire (the largest sent: a rank's RNG states, ~25 KB)."""


class PeerValueError(BadInput):
    """A peer sent a value this rank refuses (too large, not JSON, not of the expected shape)."""


def encode_json(value: object, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """`value` as compact UTF-8 JSON (finite numbers only); ValueError over `max_bytes`."""
    data = json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(data) > max_bytes:
        raise ValueError(f"a value of {len(data)} bytes is over the {max_bytes}-byte bound of a peer exchange")
    return data


def decode_json(data: bytes, max_bytes: int = MAX_JSON_BYTES) -> object:
    """What a peer sent, as plain JSON only (dicts, lists, strings, finite numbers, bools, None): size and
    nesting bounded before parsing, UTF-8 strict. Never pickle: a peer's bytes cannot name code to run
    (torch's *_object collectives unpickle whatever the sender sends, and a member
    of a live group may be a stranger until it has proved itself). PeerValueError on anything else."""
    if len(data) > max_bytes:
        raise PeerValueError(f"peer error: a peer sent {len(data)} bytes, over the {max_bytes}-byte bound")
    try:
        return load_json(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and TooComplex are ValueErrors
        raise PeerValueError(f"peer error: a peer sent a value that is not plain JSON: {quote(str(e))}") from None


def _wire_device(ctx: DistContext) -> torch.device:
    """Where a collective's tensors live: NCCL moves device tensors only, gloo host ones."""
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def _of_kind(value: object, kinds: tuple[type, ...] | None) -> object:
    """`value` when its type is one of `kinds` exactly (True is no int here), else PeerValueError."""
    if kinds is not None and type(value) not in kinds:
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise PeerValueError(f"peer error: a peer sent {quote(value, 60)} where {names} was expected")
    return value


def broadcast_json(
    ctx: DistContext,
    value: object,
    src: int = 0,
    max_bytes: int = MAX_JSON_BYTES,
    kinds: tuple[type, ...] | None = None,
) -> object:
    """`src`'s JSON value on every rank: its length, then its bytes, as an int64 and a uint8 tensor. A
    length over `max_bytes` is refused on every receiver before anything of that size is allocated;
    `kinds`: the value's type must be one of these (a schema for scalars; callers check deeper ones)."""
    return _of_kind(_broadcast_json(ctx, value, src, max_bytes), kinds)


def _broadcast_json(ctx: DistContext, value: object, src: int, max_bytes: int) -> object:
    if not ctx.distributed:
        return decode_json(encode_json(value, max_bytes), max_bytes)
    device = _wire_device(ctx)
    data = encode_json(value, max_bytes) if ctx.rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    n = int(size.item())
    if not 0 <= n <= max_bytes:
        raise PeerValueError(f"peer error: rank {src} announced {n} bytes, over the {max_bytes}-byte bound")
    if n == 0:
        return decode_json(data, max_bytes)  # nothing on the wire: not JSON, refused below as such
    if ctx.rank == src:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src)
    return decode_json(data if ctx.rank == src else payload.cpu().numpy().tobytes(), max_bytes)


def gather_json(
    ctx: DistContext, value: object, max_bytes: int = MAX_JSON_BYTES, kinds: tuple[type, ...] | None = None
) -> list[object]:
    """Every rank's JSON value, on every rank, in rank order: the lengths (every rank sees the same, so a
    length over the bound is refused by all together), then the bytes padded to the longest. `kinds`: as
    broadcast_json's, for every value."""
    return [_of_kind(v, kinds) for v in _gather_json(ctx, value, max_bytes)]


def _gather_json(ctx: DistContext, value: object, max_bytes: int) -> list[object]:
    if not ctx.distributed:
        return [decode_json(encode_json(value, max_bytes), max_bytes)]
    device = _wire_device(ctx)
    data = encode_json(value, max_bytes)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    if min(lengths) < 0 or longest > max_bytes:
        raise PeerValueError(f"peer error: a peer announced {longest} bytes, over the {max_bytes}-byte bound")
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(ctx.world_size)]
    dist.all_gather(parts, mine.to(device))
    return [decode_json(p.cpu().numpy().tobytes()[:n], max_bytes) for p, n in zip(parts, lengths, strict=True)]


def ordered_allreduce_hook(process_group, bucket):  # no annotations: DDP checks them at run time
    """DDP comm hook: average gradients by summing every rank's bucket in rank order.

    A ring all-reduce sums each element starting at a rank that depends on the element's position in
    its bucket, and DDP lays buckets out differently in the first step after it is built (parameter
    order) than later (gradient-ready order). With more than two ranks that changes the float sum, so
    a resumed run would drift from an uninterrupted one. Gathering and summing in rank order makes
    the result independent of bucket layout: bit-exact resume on CPU at any world size. Costs
    (W-1) x bucket bytes per rank instead of ~2x: fine for gloo on CPU, where exactness is promised.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    local = bucket.buffer()
    gathered = [torch.empty_like(local) for _ in range(world)]
    future = dist.all_gather(gathered, local, group=group, async_op=True).get_future()
    return future.then(lambda _: rank_order_mean(gathered, out=local))


def rank_order_mean(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """(parts[0] + parts[1] + ... ) / len(parts) into `out`, summed in rank order: the one averaging
    rule of every exact gradient path (this hook, torchlaunch/core/shm_reduce.py)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)
    return out.div_(len(parts))


# DDP validates the hook's annotations as real objects (this module uses postponed annotations).
ordered_allreduce_hook.__annotations__ = {
    "process_group": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def agreed(ctx: DistContext, build):  # noqa: ANN001, ANN201 - any builder, any result
    """Run `build` on every rank; if any rank hits bad input, every rank raises that rank's message
    together (no rank is left waiting in a collective, and the message is the real one)."""
    message: str | None = None
    result = None
    try:
        result = build()
    except BadInput as e:
        message = str(e).splitlines()[0]
    found = [m for m in gather_json(ctx, message, kinds=(str, type(None))) if m]
    if found:
        raise BadInput(str(found[0]).splitlines()[0][:2000])
    return result
