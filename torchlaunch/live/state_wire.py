"""A training state (nested dicts, lists, tuples, numbers, strings and tensors) as a JSON skeleton and
one byte buffer of its tensors, and back: how a joiner takes a live peer's state (handover.share_state).

Why not torch.save's bytes: they are a pickle, and loading them, even with weights_only=True, runs an
unpickler over what a peer chose to send; a member of a live group is the run's own rank only once it
has proved it, and the rule is that nothing a peer sends is unpickled. Here the skeleton is plain JSON
whose every node is tagged (so no value can be read as another kind), tensors are named by index into
a table of (dtype from an allow-list, shape), and the buffer's length is computed from that table and
checked, with the buffer's digest, before any tensor is built.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
"""The tensor types a training state holds (parameters, buffers, optimizer moments, step counters)."""
MAX_DIMS = 16
MAX_SKELETON_BYTES = 256 << 20
"""The JSON skeleton's bound (a ResNet-50's with its optimizer: ~50 KB)."""
MAX_TENSOR_BYTES = 1 << 40
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class StateWireError(ValueError):
    """A peer's state is not what pack() makes."""


def digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def pack(state: Any) -> tuple[dict[str, Any], bytes]:
    """(skeleton, buffer): the skeleton is JSON ({"tree", "tensors", "digest"}), the buffer every
    tensor's bytes, contiguous and on the host, in the table's order."""
    tensors: list[torch.Tensor] = []

    def node(value: Any) -> Any:
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"f": repr(value)}
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().cpu().contiguous())
            return {"T": len(tensors) - 1}
        if isinstance(value, dict):
            return {"d": [[node(k), node(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"t": [node(v) for v in value]}
        if isinstance(value, list):
            return {"l": [node(v) for v in value]}
        raise TypeError(f"a training state holds a {type(value).__name__}, which is not sent to a peer")

    tree = node(state)
    table = []
    for t in tensors:
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise TypeError(f"a training state holds a {name} tensor, which is not sent to a peer")
        table.append([name, list(t.shape)])
    blob = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors)
    return {"tree": tree, "tensors": table, "digest": digest(blob)}, blob


def buffer_size(skeleton: object) -> int:
    """The byte length the skeleton's tensor table names, every entry checked (before a buffer of that
    size is allocated): StateWireError otherwise."""
    if not (isinstance(skeleton, dict) and set(skeleton) == {"tree", "tensors", "digest"}):
        raise StateWireError("not a state's skeleton")
    if not (isinstance(skeleton["digest"], str) and len(skeleton["digest"]) == 32):
        raise StateWireError("no 32-digit digest")
    table = skeleton["tensors"]
    if not isinstance(table, list):
        raise StateWireError("no tensor table")
    total = 0
    for entry in table:
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in DTYPES and isinstance(entry[1], list)):
            raise StateWireError("a tensor entry is not [dtype, shape]")
        shape = entry[1]
        if len(shape) > MAX_DIMS or not all(type(n) is int and 0 <= n <= MAX_TENSOR_BYTES for n in shape):
            raise StateWireError("a tensor's shape is not a list of sizes")
        total += math.prod(shape) * DTYPES[entry[0]].itemsize
        if total > MAX_TENSOR_BYTES:
            raise StateWireError(f"the tensors exceed {MAX_TENSOR_BYTES} bytes")
    return total


def unpack(skeleton: dict[str, Any], blob: bytes) -> Any:
    """pack()'s inverse: the buffer checked against the skeleton's length and digest first, then every
    node of the tree against the tags pack() writes. StateWireError on anything else."""
    if len(blob) != buffer_size(skeleton):
        raise StateWireError(f"{len(blob)} bytes where the table names {buffer_size(skeleton)}")
    if digest(blob) != skeleton["digest"]:
        raise StateWireError(f"its {len(blob)} bytes do not match their digest")
    tensors, offset = [], 0
    for name, shape in skeleton["tensors"]:
        dtype = DTYPES[name]
        size = math.prod(shape) * dtype.itemsize
        raw = torch.frombuffer(bytearray(blob[offset : offset + size]), dtype=torch.uint8) if size else None
        tensors.append(raw.view(dtype).reshape(shape) if raw is not None else torch.empty(shape, dtype=dtype))
        offset += size
    used: set[int] = set()

    def node(value: Any) -> Any:
        if value is None or isinstance(value, bool | int | str | float):
            return value
        if not (isinstance(value, dict) and len(value) == 1):
            raise StateWireError("a node is not tagged")
        ((tag, inner),) = value.items()
        if tag == "T" and type(inner) is int and 0 <= inner < len(tensors) and inner not in used:
            used.add(inner)
            return tensors[inner]
        if tag == "f" and inner in NON_FINITE:
            return NON_FINITE[inner]
        if tag in ("l", "t") and isinstance(inner, list):
            items = [node(v) for v in inner]
            return items if tag == "l" else tuple(items)
        if tag == "d" and isinstance(inner, list) and all(isinstance(p, list) and len(p) == 2 for p in inner):
            keys = [node(k) for k, _ in inner]
            if not all(k is None or isinstance(k, bool | int | str | float) for k in keys):
                raise StateWireError("a mapping's key is not a plain value")
            return {k: node(v) for k, (_, v) in zip(keys, inner, strict=True)}
        raise StateWireError(f"a node tagged {tag[:8]!r} is not what a state holds")

    return node(skeleton["tree"])
