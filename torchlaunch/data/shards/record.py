"""What the writer recorded, kept apart from the indexes: each shard's size and xxh3 as written.

Why apart: an index is rebuilt from the bytes it finds (`python -m train.shards index DIR`), so an index
alone cannot tell a shard that changed after it was written from one that never did; rebuilt over a
flipped byte, it would bless the corruption. `SPLIT/written.xxh3` is written once by the writer,
beside the shards, and never by the indexer: `verify` checks each shard against it as well as
against its index, `index` refuses to index over bytes that differ from it (or from the index that
was there) unless told `--accept-changed`, and a rerun of the same write rewrites exactly the shards
that differ from it. A line per shard, `XXH3 SIZE NAME`: a few MB at 100,000 shards, read only by
`verify`, `index` and the writer, never when a set is opened for training.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from torchlaunch.data.shards.errors import ShardError
from torchlaunch.data.shards.fsio import read_all, regular_size, write_durable

SUMS = "written.xxh3"
WRITE_PLAN = ".write-plan.json"
"""The writer's plan (sources and options) in DIR: its presence without DIR/manifest.json marks a
write that has not finished."""
MAX_SUMS_BYTES = 64 << 20
_LINE = re.compile(r"([0-9a-f]{1,16}) ([0-9]{1,20}) ([A-Za-z0-9._-]{1,255})")


def write_sums(folder: Path, shards: list[Any]) -> None:
    """Record the shards (ShardInfo: name, size, xxh3) as the writer wrote them."""
    write_durable(folder / SUMS, ["".join(f"{s.xxh3} {s.size} {s.name}\n" for s in shards).encode()])


def read_sums(folder: Path) -> dict[str, tuple[int, str]]:
    """name -> (size, xxh3) the writer recorded for `folder`; empty when it recorded nothing (a set
    written by another tool). A damaged record is a ShardError: it cannot vouch for anything."""
    path = folder / SUMS
    fix = f"restore {SUMS} from a copy of the set, or rewrite the set with python -m train.shards write"
    size = regular_size(path, "writer's record", fix)
    if size is None:
        return {}
    if size > MAX_SUMS_BYTES:
        raise ShardError(f"writer's record {path} is larger than {MAX_SUMS_BYTES} bytes", fix)
    sums: dict[str, tuple[int, str]] = {}
    for n, line in enumerate(read_all(path, "writer's record", fix).split(b"\n"), 1):
        m = _LINE.fullmatch(line.decode("ascii", "replace"))
        if m is None and line:
            raise ShardError(f"writer's record {path} is damaged (line {n})", fix)
        if m is not None:
            sums[m.group(3)] = (int(m.group(2)), m.group(1))
    return sums


def rewrite_command(manifest: dict[str, Any] | None, root: Path) -> str | None:
    """The write command that wrote the set at `root` (from its manifest: sources and options), which
    rewrites exactly the shards that differ from what it recorded; None for a set without one."""
    if manifest is None:
        return None
    source, options = manifest.get("source"), manifest.get("options")
    if not isinstance(source, dict) or not isinstance(options, dict) or not isinstance(source.get("train_from"), str):
        return None
    argv = ["python", "-m", "train.shards", "write", "--from", source["train_from"], "--out", str(root)]
    if isinstance(source.get("val_from"), str):
        argv += ["--val-from", source["val_from"]]
    elif isinstance(source.get("val_fraction"), int | float):
        argv += ["--val-fraction", repr(source["val_fraction"])]
    for key, flag in (
        ("max_side", "--max-side"),
        ("quality", "--quality"),
        ("shard_size_mb", "--shard-size-mb"),
        ("split_seed", "--split-seed"),
    ):
        value = options.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            argv += [flag, repr(value)]
    return shlex.join(argv)


def repair_fix(manifest: dict[str, Any] | None, root: Path) -> str:
    """How a user repairs a shard whose bytes changed: the writer's rerun or a good copy, never a
    re-index (which would describe the changed bytes and so hide them)."""
    command = rewrite_command(manifest, root)
    if command is not None:
        return f"restore a good copy of it, or rewrite it from the source (only shards that differ are rewritten): {command}"
    return (
        "restore a good copy of it from where the set came from, since re-indexing does not repair it; if the new "
        f"bytes are intended: python -m train.shards index --accept-changed {shlex.quote(str(root))}"
    )
