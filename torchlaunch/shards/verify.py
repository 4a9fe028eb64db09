"""`python -m train.shards index DIR` and `... verify DIR`: index shards written by other tools, and
check a set end to end (every shard's size and checksum against its index, every member's checksum
and a full decode), one line per bad shard or member."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from torchlaunch.shards.decode import decode
from torchlaunch.shards.errors import ShardError
from torchlaunch.shards.fsio import open_regular, regular_size
from torchlaunch.shards.index import (
    DEFAULT_LABEL,
    REINDEX,
    file_xxh3,
    index_path,
    label_source,
    load,
    matches,
    write_set_index,
    write_shard_index,
)
from torchlaunch.shards.reader import ShardSet, list_shards


def split_folders(root: Path) -> list[Path]:
    """The split folders under DIR (those of its subfolders that hold .tar shards), or DIR itself."""
    if list_shards(root):
        return [root]
    try:
        subs = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))
    except OSError as e:
        raise ShardError(f"{root} cannot be listed ({e.strerror})", "point at a folder of .tar shards") from None
    found = [p for p in subs if list_shards(p)]
    if not found:
        raise ShardError(
            f"{root} holds no .tar shards (nor do its subfolders)", "point at the folder of the .tar files"
        )
    return found


def index_folder(root: Path, log=print, label: str = DEFAULT_LABEL) -> int:
    """Build the missing or stale per-shard indexes (and those built from another label source) and
    each split's set index; returns shards indexed."""
    label_source(label)  # a bad source is refused before anything is written
    built = 0
    for folder in split_folders(root):
        parts = []
        for name in list_shards(folder):
            shard, idx = folder / name, index_path(folder / name)
            current = None
            if regular_size(idx, "index", f"delete {idx}") is not None:
                try:
                    current = load(idx, "shard")
                except ShardError:
                    current = None
            if (
                current is None
                or current.shards[0].name != name
                or current.label != label
                or not matches(current, shard)
            ):
                current = write_shard_index(shard, label)
                built += 1
                log(f"shards: indexed {shard} ({len(current):,} samples)")
            parts.append(current)
        write_set_index(folder, parts)
    return built


def verify_folder(root: Path) -> Iterator[str]:
    """One line per problem found (empty when the set is good)."""
    for folder in split_folders(root):
        try:
            ss = ShardSet.open(folder, label=None)  # whatever source the indexes were built from
        except ShardError as e:
            yield str(e)
            continue
        for s, info in enumerate(ss.shards):
            path = folder / info.name
            try:
                fd, size = open_regular(path, "shard", REINDEX)
            except ShardError as e:
                yield str(e)
                continue
            try:
                if size != info.size:
                    yield f"data error: shard {path} has {size} bytes, its index says {info.size} ({REINDEX})"
                    continue
                if file_xxh3(fd, size) != info.xxh3:
                    yield f"data error: shard {path} does not match its index checksum ({REINDEX}, or replace the shard)"
            finally:
                os.close(fd)
            start = int(ss._starts[s])
            for i in range(start, start + info.count):
                try:
                    decode(ss.read(i), ss.where(i))
                except ShardError as e:
                    yield str(e)
        ss.close()
