"""What a shard index may hold: the checks between its bytes and the code that trusts them.

Why a module of its own: an index is a file anyone may have written, and its header checksum
(xxh3) proves only that it was not damaged by accident; a forged index carries a valid one. So every
value the reader, the loaders and the class list go on to use is checked here once, where the index
is built (`build`, before anything is written) and where it is loaded (`load`): a column's dtype,
shape and extent before a buffer is allocated for it, then labels in 0..MAX_CLASSES-1, image sizes
of at least 1 pixel (a 0 was a ZeroDivisionError in a loader worker, a negative trained silently),
extension codes that name an extension, and every member inside its shard. Vectorised: ~10 ms for
1.28 M samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlaunch.shards.errors import ShardError

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
    if any(not (0 <= s.count and 0 <= s.size < 1 << 63) for s in shards):
        raise ShardError(f"{what} is inconsistent (a shard with an impossible size or sample count)", fix)
    if sum(s.count for s in shards) != n:
        raise ShardError(f"{what} is inconsistent (shard counts do not add up to {n})", fix)
    if n == 0:
        return
    labels = columns["label"]
    bad = np.flatnonzero((labels < 0) | (labels >= MAX_CLASSES))
    if bad.size:
        raise ShardError(
            f"{what}: sample {int(bad[0])} has class {int(labels[bad[0]])}, outside 0..{MAX_CLASSES - 1}", fix
        )
    sizes = columns["size"]
    bad = np.flatnonzero((sizes < 1).any(axis=1))
    if bad.size:
        w, h = (int(x) for x in sizes[bad[0]])
        raise ShardError(f"{what}: sample {int(bad[0])} has an image size of {w}x{h} (at least 1x1)", fix)
    bad = np.flatnonzero(columns["ext"] >= n_exts)
    if bad.size:
        raise ShardError(
            f"{what}: sample {int(bad[0])} has an unknown image type code {int(columns['ext'][bad[0]])}", fix
        )
    limit = np.repeat(np.array([s.size for s in shards], dtype=np.uint64), [s.count for s in shards])
    offset, nbytes = columns["offset"], columns["nbytes"].astype(np.uint64)
    bad = np.flatnonzero((offset > limit) | (nbytes > limit - np.minimum(offset, limit)))
    if bad.size:
        raise ShardError(f"{what}: sample {int(bad[0])} lies past the end of its shard", fix)
