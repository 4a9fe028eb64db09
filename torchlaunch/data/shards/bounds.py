"""What a shard index may hold: the checks between its bytes and the code that trusts them.

Why a module of its own: an index is a file anyone may have written, and its header checksum
(xxh3) proves only that it was not damaged by accident; a forged index carries a valid one. So every
value the reader, the loaders and the class list go on to use is checked here once, where the index
is built (`build`, before anything is written) and where it is loaded (`load`): a column's dtype,
shape and extent before a buffer is allocated for it, then labels in 0..MAX_CLASSES-1, image sizes
of at least 1 pixel (a 0 was a ZeroDivisionError in a loader worker, a negative trained silently),
extension codes that name an extension, and every member inside its shard. Vectorised, min/max first: ~15 ms for
1.28 M samples in 1,025 shards (the search for the first bad sample runs only on failure).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlaunch.data.shards.errors import ShardError

MAX_CLASSES = 1 << 20
"""Most classes a set may have (labels 0..MAX_CLASSES-1): far above any image-classification set
(ImageNet-21k has 21,841, Google Landmarks v2 203,094), low enough that the class list a set without
a manifest gets (one name per index up to the largest label) stays a few MB."""
MAX_KEY_BYTES = 4096
"""Widest key column accepted: a key is a tar member name, which is far shorter in any real shard."""


def column_layout(what: str, name: str, d: dict[str, Any], expected: str | None, file_size: int, fix: str):
    """(dtype, shape, nbytes) of a column described by `d`, checked before any buffer is allocated:
    the dtype expected (or, for keys, plain bytes), a shape of at most 2 non-negative sides whose
    extent lies inside the file. Python ints throughout: a forged shape cannot overflow a product."""
    if not isinstance(d.get("dtype"), str):
        raise ShardError(f"{what}: column {name} has no dtype", fix)
    dtype = np.dtype(d["dtype"])
    if expected is not None and dtype != np.dtype(expected):
        raise ShardError(f"{what}: column {name} has dtype {dtype}, expected {expected}", fix)
    if expected is None and (dtype.kind != "S" or dtype.itemsize > MAX_KEY_BYTES):
        raise ShardError(f"{what}: column {name} has dtype {dtype}, expected bytes of at most {MAX_KEY_BYTES}", fix)
    shape = tuple(int(x) for x in d["shape"])
    at = int(d["at"])
    if not 1 <= len(shape) <= 2 or any(x < 0 for x in shape) or at < 0:
        raise ShardError(f"{what}: column {name} has an impossible shape {list(shape)[:4]} or offset {at}", fix)
    nbytes = dtype.itemsize
    for x in shape:
        nbytes *= x
    if nbytes > file_size:
        raise ShardError(f"{what} is truncated (column {name} ends past the file)", fix)
    return dtype, shape, nbytes


def check_index(what: str, shards: list[Any], columns: dict[str, np.ndarray], n_exts: int, fix: str) -> None:
    """Every value the readers use is in range (see the module docstring); ShardError naming `what`
    (the index or shard) and the first sample out of range otherwise."""
    n = int(columns["label"].shape[0])
    if any(c.ndim != 1 for k, c in columns.items() if k not in ("size", "key")):
        raise ShardError(f"{what} is inconsistent (a column is not one value per sample)", fix)
    try:  # one pass over the shard list (100,000 shards: ~20 ms), then numpy
        counts = np.fromiter((s.count for s in shards), dtype=np.int64, count=len(shards))
        limit = np.fromiter((s.size for s in shards), dtype=np.int64, count=len(shards))
    except OverflowError:
        counts = limit = np.array([-1])
    if len(shards) and (counts.min() < 0 or limit.min() < 0 or counts.max() > n):
        raise ShardError(f"{what} is inconsistent (a shard with an impossible size or sample count)", fix)
    if int(counts.sum()) != n:
        raise ShardError(f"{what} is inconsistent (shard counts do not add up to {n})", fix)
    if n == 0:
        return
    labels = columns["label"]
    if labels.min() < 0 or labels.max() >= MAX_CLASSES:  # min/max first: the search below only on failure
        i = int(np.flatnonzero((labels < 0) | (labels >= MAX_CLASSES))[0])
        raise ShardError(f"{what}: sample {i} has class {int(labels[i])}, outside 0..{MAX_CLASSES - 1}", fix)
    sizes = columns["size"]
    if sizes.min() < 1:
        i = int(np.flatnonzero((sizes < 1).any(axis=1))[0])
        w, h = (int(x) for x in sizes[i])
        raise ShardError(f"{what}: sample {i} has an image size of {w}x{h} (at least 1x1)", fix)
    ext = columns["ext"]
    if ext.max() >= n_exts:
        i = int(np.flatnonzero(ext >= n_exts)[0])
        raise ShardError(f"{what}: sample {i} has an unknown image type code {int(ext[i])}", fix)
    # every member ends inside its shard: the largest end per shard against the shard's size
    held = counts > 0
    starts = (np.cumsum(counts) - counts)[held]
    limit = limit.astype(np.uint64)
    offset = columns["offset"]
    end = offset + columns["nbytes"] if offset.max() < 1 << 63 else None  # below 2^63: the sum cannot wrap
    if end is None or (np.maximum.reduceat(end, starts) > limit[held]).any():
        per_sample = np.repeat(limit, counts)
        past = (offset > per_sample) | (offset + columns["nbytes"] > per_sample)  # a wrapped sum fails the first
        i = int(np.flatnonzero(past)[0])
        raise ShardError(f"{what}: sample {i} lies past the end of its shard", fix)
