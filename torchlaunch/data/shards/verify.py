"""`python -m train.shards index DIR` and `... verify DIR`: index shards written by other tools, and
check a set end to end (every shard's size and checksum against its index and against what the
writer recorded, every member's checksum and a full decode), one line per bad shard or member.
`index` never rebuilds over a shard whose bytes changed (record.py says why) unless told to."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from torchlaunch.data.shards.decode import decode
from torchlaunch.data.shards.errors import ShardError
from torchlaunch.data.shards.fsio import open_regular, regular_size
from torchlaunch.data.shards.index import (
    DEFAULT_LABEL,
    REINDEX,
    Index,
    file_xxh3,
    index_path,
    label_source,
    load,
    write_set_index,
    write_shard_index,
)
from torchlaunch.data.shards.reader import ShardSet, list_shards, read_manifest
from torchlaunch.data.shards.record import SUMS, read_sums, repair_fix


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


def manifest_of(folder: Path) -> tuple[dict | None, Path]:
    """A split folder's set manifest (ours, else None) and the set's root, found as ShardSet.open finds them."""
    for root in (folder.parent, folder):
        manifest = read_manifest(root)
        if manifest is not None:
            return manifest, root
    return None, folder


def digest(shard: Path, fix: str) -> tuple[int, str]:
    """(size, xxh3) of a shard as it is now (reads the whole file)."""
    fd, size = open_regular(shard, "shard", fix)
    try:
        return size, file_xxh3(fd, size)
    finally:
        os.close(fd)


def index_folder(root: Path, log=print, label: str = DEFAULT_LABEL, accept_changed: bool = False) -> int:
    """Build the missing or stale per-shard indexes (and those built from another label source) and
    each split's set index; returns shards indexed.

    A shard whose bytes differ from the index that was there, or from what the writer recorded
    (record.SUMS), is not re-indexed without `accept_changed`: an index built over them would call
    the change good (verify would then pass a flipped byte). The refusal comes before anything is
    written and says how to repair the shard for real."""
    label_source(label)  # a bad source is refused before anything is written
    plans: list[tuple[Path, list[tuple[Path, Index | None]]]] = []
    changed: list[tuple[Path, str, str]] = []
    for folder in split_folders(root):
        manifest, set_root = manifest_of(folder)
        sums = read_sums(folder)
        todo: list[tuple[Path, Index | None]] = []
        for name in list_shards(folder):
            shard, idx = folder / name, index_path(folder / name)
            current = None
            if regular_size(idx, "index", f"delete {idx}") is not None:
                try:
                    current = load(idx, "shard")
                except ShardError:
                    current = None  # a damaged or foreign index vouches for nothing: rebuilt
            if current is not None and (len(current.shards) != 1 or current.shards[0].name != name):
                current = None
            now = digest(shard, REINDEX)
            if name in sums and sums[name] != now:
                changed.append((shard, f"what the writer recorded ({SUMS})", repair_fix(manifest, set_root)))
            elif current is not None and (current.shards[0].size, current.shards[0].xxh3) != now:
                changed.append((shard, "its index", repair_fix(manifest, set_root)))
            same = current is not None and (current.shards[0].size, current.shards[0].xxh3) == now
            # an index from another label source is rebuilt over the same bytes: not a change to accept
            keep = same and current is not None and current.label == label
            todo.append((shard, current if keep else None))
        plans.append((folder, todo))
    if changed and not accept_changed:
        shard, against, fix = changed[0]
        more = f" ({len(changed)} shards in all)" if len(changed) > 1 else ""
        raise ShardError(
            f"shard {shard} differs from {against}{more}: an index built now would call the changed bytes good", fix
        )
    built = 0
    for folder, todo in plans:
        parts = []
        for shard, current in todo:
            if current is None:
                current = write_shard_index(shard, label)
                built += 1
                log(f"shards: indexed {shard} ({len(current):,} samples)")
            parts.append(current)
        write_set_index(folder, parts)
    return built


def verify_folder(root: Path) -> Iterator[str]:
    """One line per problem found (empty when the set is good): each shard against its index and
    against what the writer recorded, then each member's checksum and a full decode."""
    for folder in split_folders(root):
        try:
            ss = ShardSet.open(folder, label=None)  # whatever source the indexes were built from
            manifest, set_root = manifest_of(folder)
            sums = read_sums(folder)
        except ShardError as e:
            yield str(e)
            continue
        fix = repair_fix(manifest, set_root)
        for s, info in enumerate(ss.shards):
            path = folder / info.name
            try:
                now = digest(path, fix)
            except ShardError as e:
                yield str(e)
                continue
            if now[0] != info.size:
                yield str(ShardError(f"shard {path} has {now[0]} bytes, its index says {info.size}", fix))
                continue
            if now[1] != info.xxh3:
                yield str(ShardError(f"shard {path} does not match its index checksum", fix))
            elif info.name in sums and sums[info.name] != now:
                yield str(
                    ShardError(
                        f"shard {path} differs from what the writer recorded ({SUMS}): it changed after it was "
                        "written, and its index was rebuilt over the change",
                        fix,
                    )
                )
            start = int(ss._starts[s])
            if info.count:
                try:  # the keys are read only when an error line needs one: check they can be
                    ss.key(start)
                except ShardError as e:
                    yield str(e)
            for i in range(start, start + info.count):
                try:
                    decode(ss.read(i), ss.where(i))
                except ShardError as e:
                    yield str(e)
        ss.close()
