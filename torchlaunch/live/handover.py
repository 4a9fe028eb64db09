"""A peer's training state handed to a rank of the live group that has none (a rank started again, or
a survivor a step behind), and the digest that shows every member holds the same model afterwards.
What travels is state_wire's format (a bounded JSON skeleton and one checked buffer): nothing a peer
sends is unpickled."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from torchlaunch.core.dist import DistContext, PeerValueError, broadcast_json
from torchlaunch.live import state_wire


def share_state(ctx: DistContext, src: int, state: dict[str, Any] | None) -> dict[str, Any]:
    """`src`'s training state on every member (a joining rank takes it; the others return their own): a
    JSON skeleton (broadcast_json, bounded) and one buffer of its tensors' bytes (live/
    state_wire.py), the buffer's length and digest checked before any tensor is built. Nothing a peer
    sends is unpickled. BadInput (PeerValueError) when what arrives is not a state pack() made."""
    if ctx.rank == src:
        assert state is not None
        skeleton, blob = state_wire.pack(state)
    else:
        skeleton, blob = None, b""
    got = broadcast_json(ctx, skeleton, src=src, max_bytes=state_wire.MAX_SKELETON_BYTES, kinds=(dict,))
    try:
        size = state_wire.buffer_size(got)
    except state_wire.StateWireError as e:
        raise PeerValueError(f"live error: the state announced by rank {src} is refused ({e})") from None
    if ctx.rank == src and blob:
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    else:
        payload = torch.empty(size, dtype=torch.uint8)
    if size:
        dist.broadcast(payload, src=src)
    if ctx.rank == src:
        return state  # type: ignore[return-value]
    try:
        return state_wire.unpack(got, payload.numpy().tobytes())  # type: ignore[arg-type]
    except state_wire.StateWireError as e:
        raise PeerValueError(f"live error: the state taken from rank {src} is refused ({e})") from None


def state_digest(module: torch.nn.Module) -> str:
    """A digest of a module's parameters and buffers: equal on every member after a rank took its state."""
    h = hashlib.blake2b(digest_size=16)
    for tensor in [*module.parameters(), *module.buffers()]:
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
