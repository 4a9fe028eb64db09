"""ShardSet: a folder of tar shards opened from its indexes, read by global sample index.

Opening reads the folder listing (once: its entry types refuse a symlink or FIFO in a shard's place
without a stat), the manifest and the set index (`shards.idx`; the per-shard indexes when it is
absent or lists other shards): no file per shard, nothing proportional to the number of samples but
the index arrays themselves, and no tar is scanned (issue 38: 100,000 shards in well under 2 s). A
shard's size is checked against its index when the shard is first read, as its descriptor is
opened; a read is one os.pread on a cached descriptor plus an xxh3_64 of the member, so a corrupt
member is found where it is read, not trained on.

Fork-safety: descriptors are cached per process id; a DataLoader worker forked from a process that
already read finds a different pid, drops the inherited cache and opens its own. At most MAX_FDS
shards are held open per process (least recently used closed first), so a set of thousands of shards
times several workers stays far below the usual 1,024-descriptor limit.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from torchlaunch.base.files import read_json
from torchlaunch.data.shards.errors import ShardError, shown
from torchlaunch.data.shards.fsio import open_regular, regular_size
from torchlaunch.data.shards.index import (
    DEFAULT_LABEL,
    EXTS,
    INDEX_SUFFIX,
    REINDEX,
    SET_INDEX,
    Index,
    KeyColumn,
    ShardInfo,
    index_path,
    load,
    read_key,
    split_name,
    write_set_index,
)
from torchlaunch.data.shards.record import WRITE_PLAN
from torchlaunch.exit_codes import BadInput
from torchlaunch.rundir import check_real_folder

MAX_FDS = 64
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "torchlaunch-shards"
MANIFEST_VERSION = 1
MAX_MANIFEST = 64 << 20
"""manifest.json lists every shard (~20 bytes each): 2 MB at 100,000 shards, so the 256 KB cap of the
run-record files would refuse the writer's own manifest of a large set (issue 38)."""
FIX_SHARD = (
    "restore a good copy of the shard, or rewrite it from the source with python -m train.shards write "
    "(`python -m train.shards verify DIR` gives the command); re-indexing does not repair it"
)


def list_folder(folder: Path) -> list[os.DirEntry]:
    """Every entry of a split folder (one listing: a 100,000-shard folder holds 200,000 names)."""
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except FileNotFoundError:
        if folder.name == "val" and os.path.isdir(folder.parent / "train"):  # a set written with no val split
            raise ShardError(
                f"shard set {folder.parent} has no val/ split",
                "write it with one: python -m train.shards write --from CLASS_FOLDERS --out DIR --val-fraction 0.02 "
                "(or --val-from VAL_CLASS_FOLDERS)",
            ) from None
        raise ShardError(
            f"shard folder {folder} does not exist",
            "point data.root at the folder `python -m train.shards write` wrote",
        ) from None
    except NotADirectoryError:
        raise ShardError(f"{folder} is not a folder", "point data.root at a folder of .tar shards") from None
    except OSError as e:
        raise ShardError(f"shard folder {folder} cannot be listed ({e.strerror})", "check its permissions") from None


def is_shard_name(name: str) -> bool:
    return name.endswith(".tar") and not name.startswith(".")


def shard_names(listing: list[os.DirEntry]) -> list[str]:
    """The shard names of a folder listing, sorted: the global sample order is shard by shard."""
    return sorted(e.name for e in listing if is_shard_name(e.name))


def list_shards(folder: Path) -> list[str]:
    """The shard names of a split folder, sorted (see shard_names)."""
    return shard_names(list_folder(folder))


def scan_split(folder: Path, listing: list[os.DirEntry]) -> tuple[list[str], list[str]]:
    """(shard names sorted, orphans: shards whose `NAME.tar.idx` is there but not the shard) from one
    listing, in C-level passes (comprehensions; a folder holds 200,000 names). A shard name that is not a regular file (symlink, FIFO, folder...) is refused from
    the entry's type: no stat per shard (only a filesystem without entry types, or a bad entry, costs
    one). Orphans are a set difference: the old membership test in a list was O(shards^2), 276 s at
    100,000 shards (issue 38)."""
    for e in listing:
        if not e.is_file(follow_symlinks=False) and is_shard_name(e.name):
            regular_size(folder / e.name, "shard", FIX_SHARD)  # raises, naming what it is
    every = [e.name for e in listing]
    names = sorted(n for n in every if n.endswith(".tar") and not n.startswith("."))  # is_shard_name, inlined
    cut = len(INDEX_SUFFIX)
    indexed = [n[:-cut] for n in every if n.endswith(".tar" + INDEX_SUFFIX)]
    return names, sorted(set(indexed).difference(names))


def split_folder(folder: Path, split: str | None) -> tuple[Path, list[os.DirEntry]]:
    """A split folder and its listing: `folder` itself when it holds shards, else folder/split (train
    by default). The listing comes back so that opening lists a large folder once."""
    if split is not None:
        return folder / split, list_folder(folder / split)
    listing = list_folder(folder)
    if not any(is_shard_name(e.name) for e in listing) and (folder / "train").is_dir():
        return folder / "train", list_folder(folder / "train")
    return folder, listing


def read_manifest(root: Path) -> dict[str, Any] | None:
    """DIR/manifest.json if it is ours; ShardError when it is ours but unusable (or a symlink/FIFO)."""
    path = root / MANIFEST
    if regular_size(path, "manifest", "delete it or rewrite the set") is None:
        return None
    doc, why = read_json(path, limit=MAX_MANIFEST)
    if doc is None:
        raise ShardError(
            f"manifest {path} is {why}", "rewrite the set with python -m train.shards write, or delete the manifest"
        )
    if doc.get("format") != MANIFEST_FORMAT:
        return None  # another tool's manifest.json (a parent folder may hold anything): not ours to read
    version = doc.get("version")
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        raise ShardError(
            f"manifest {path} has format version {version!r}, newer than this torchlaunch's {MANIFEST_VERSION}",
            "upgrade torchlaunch",
        )
    classes = doc.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ShardError(f"manifest {path} has no class list", "rewrite the set with python -m train.shards write")
    splits = doc.get("splits", {})
    if not isinstance(splits, dict) or not all(isinstance(v, dict) for v in splits.values()):
        raise ShardError(
            f"manifest {path} has a damaged split table (`splits` must map each split's name to an object)",
            "rewrite the set with python -m train.shards write, or delete the manifest",
        )
    return doc


KeyColumns = list[KeyColumn]
"""Where the keys are (Index.key_column): one entry for a set index, else one per shard."""


def check_label(index: Index, label: str | None, folder: Path) -> None:
    """The index was built from the label source the run asks for (data.shard_label; None: any)."""
    if label is not None and index.label != label:
        raise ShardError(
            f"{folder}: its indexes take labels from {index.label!r}, data.shard_label is {label!r}",
            f"set data.shard_label={index.label}, or rebuild them: python -m train.shards index DIR --label {label}",
        )


def remember_set_index(folder: Path, parts: list[Index]) -> bool:
    """Write the split's set index from the per-shard indexes an open just read (index.write_set_index,
    what `train.shards index DIR` ends with), so that every later open of the split (each rank, each
    requeue) reads one file instead of one per shard: 100,000 per-shard indexes took ~100 s an open.
    Best effort, never an error: a read-only or linked folder (nothing is written through a link) or
    indexes of mixed label sources leave the set as it was (False)."""
    try:
        check_real_folder(folder, prefix="", what="the split folder", fix="")
        write_set_index(folder, parts)
    except (OSError, ShardError, BadInput):
        return False
    return True


def load_indexes(
    folder: Path, names: list[str], label: str | None = DEFAULT_LABEL, remember: bool = False
) -> tuple[list[ShardInfo], dict[str, np.ndarray], KeyColumns]:
    """The shards' index columns: from the set index when it lists exactly these shards, else from
    every per-shard index (the third value: where their keys are), then written as the set index when
    `remember` (remember_set_index). A shard replaced after the set index was written is found by its
    size when it is first read (ShardSet._fd), not by a stat of every shard here: that was 100,000
    stats per open (issue 38)."""
    set_path = folder / SET_INDEX
    if (
        regular_size(set_path, "set index", f"delete {set_path}; it is rebuilt by python -m train.shards index DIR")
        is not None
    ):
        whole = load(set_path, "set")
        if [s.name for s in whole.shards] == names:
            check_label(whole, label, folder)
            return whole.shards, whole.columns, [whole.key_column()]
    parts: list[Index] = []
    for name in names:
        idx = index_path(folder / name)
        if regular_size(idx, "index", REINDEX) is None:
            raise ShardError(
                f"shard {folder / name} has no index ({idx.name} missing)", REINDEX.replace("DIR", str(folder))
            )
        part = load(idx, "shard")
        if len(part.shards) != 1 or part.shards[0].name != name:
            raise ShardError(
                f"index {idx} describes another shard ({part.shards[0].name if part.shards else 'none'})", REINDEX
            )
        check_label(part, label, folder)
        parts.append(part)
    shards = [p.shards[0] for p in parts]
    columns = {c: np.concatenate([p.columns[c] for p in parts]) for c in parts[0].columns} if parts else {}
    if remember and parts:
        remember_set_index(folder, parts)
    return shards, columns, [p.key_column() for p in parts]


class ShardSet:
    """Random access to the samples of a shard folder (see the module docstring).

    labels: int64 class of every sample; sizes: (N, 2) int32 width, height of every stored image;
    classes: class names; fingerprint: a stable id of the set's contents (shard names, sizes,
    checksums), for caches and checkpoints."""

    labels: np.ndarray
    sizes: np.ndarray
    classes: list[str]
    fingerprint: str

    def __init__(
        self,
        folder: Path,
        shards: list[ShardInfo],
        columns: dict[str, np.ndarray],
        classes: list[str],
        key_columns: KeyColumns,
    ) -> None:
        self.folder = folder
        self.shards = shards
        self.labels = columns["label"]
        self.sizes = columns["size"]
        self.classes = classes
        self._offset = columns["offset"]
        self._nbytes = columns["nbytes"]
        self._xxh3 = columns["xxh3"]
        self._ext = columns["ext"]
        self._starts = np.cumsum([0] + [s.count for s in shards], dtype=np.int64)
        self._key_columns = key_columns
        h = xxhash.xxh3_128()
        # one update of the joined text: the same digest as one update per shard (a streaming hash), fewer calls
        h.update("".join(f"{s.name}\0{s.size}\0{s.xxh3}\0{s.count}\n" for s in shards).encode())
        h.update("\0".join(classes).encode())
        self.fingerprint = "shards-" + h.hexdigest()[:24]
        self._pid = -1
        self._fds: OrderedDict[int | str, int] = OrderedDict()  # shard number or key file -> descriptor

    @classmethod
    def open(
        cls, folder: str | Path, split: str | None = None, label: str | None = DEFAULT_LABEL, remember: bool = False
    ) -> ShardSet:
        """Open a split folder (DIR/train), or DIR itself with `split` (default: DIR/train when DIR holds
        no shards). Reads only the listing and the indexes; ShardError names what is wrong and the fix.
        `label`: the label source the indexes must have been built from (data.shard_label; None: any).
        `remember`: a split without a (matching) set index gets one written (remember_set_index), so
        only the first open reads one index per shard; off for readers that must write nothing (verify)."""
        root = Path(folder).expanduser()
        folder, listing = split_folder(root, split)
        names, orphans = scan_split(folder, listing)
        if not names:
            raise ShardError(
                f"{folder} holds no .tar shards", "point data.root at a folder written by python -m train.shards write"
            )
        manifest = read_manifest(folder.parent) or read_manifest(folder)
        if manifest is None and os.path.lexists(folder.parent / WRITE_PLAN):
            raise ShardError(
                f"{folder.parent} holds a shard write that did not finish (no {MANIFEST})",
                "rerun the python -m train.shards write command that wrote it: it continues where it stopped",
            )
        if manifest is not None:
            listed = manifest.get("splits", {}).get(folder.name, {}).get("shards")
            if isinstance(listed, list) and listed != names:  # the writer's list is sorted: equal is O(n), no sets
                missing = sorted(set(listed) - set(names))
                if missing:
                    raise ShardError(
                        f"shard {folder / missing[0]} is missing ({len(missing)} of {len(listed)} listed in the manifest)",
                        FIX_SHARD,
                    )
        if orphans:
            raise ShardError(
                f"shard {folder / orphans[0]} is missing (its index {orphans[0]}.idx is present)", FIX_SHARD
            )
        shards, columns, key_columns = load_indexes(folder, names, label, remember)
        labels = columns["label"]
        top = int(labels.max()) + 1 if len(labels) else 0
        if manifest is not None:
            classes = list(manifest["classes"])
            if top > len(classes):
                raise ShardError(
                    f"{folder}: a sample has class {top - 1} but the manifest names {len(classes)} classes",
                    "rewrite the set, or fix manifest.json's classes",
                )
        else:
            classes = [str(i) for i in range(top)]
        return cls(folder, shards, columns, classes, key_columns)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fds"] = OrderedDict()
        state["_pid"] = -1
        return state

    def _shard_of(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return int(np.searchsorted(self._starts, i, side="right")) - 1

    def _cached(self, slot: int | str) -> int | None:
        """The descriptor cached under `slot` in this process (a fork's inherited ones are dropped)."""
        pid = os.getpid()
        if pid != self._pid:
            if self._pid != -1:
                for fd in self._fds.values():
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._fds = OrderedDict()
            self._pid = pid
        fd = self._fds.get(slot)
        if fd is not None:
            self._fds.move_to_end(slot)
        return fd

    def _remember(self, slot: int | str, fd: int) -> int:
        self._fds[slot] = fd
        if len(self._fds) > MAX_FDS:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def _fd(self, s: int) -> int:
        fd = self._cached(s)
        if fd is not None:
            return fd
        info = self.shards[s]
        path = self.folder / info.name
        fd, size = open_regular(path, "shard", FIX_SHARD)
        if size != info.size:
            os.close(fd)
            change = "truncated" if size < info.size else "longer than indexed"
            raise ShardError(f"shard {path} is {change} ({size} bytes, its index says {info.size})", FIX_SHARD)
        return self._remember(s, fd)

    def _key_fd(self, path: Path) -> int:
        """A cached descriptor of an index file's key column: the loaders name every sample they read
        (ShardSamples.open, the GPU path), so a key read must not cost an open (an RPC on Lustre/NFS)."""
        fd = self._cached(str(path))
        return fd if fd is not None else self._remember(str(path), open_regular(path, "index", REINDEX)[0])

    def read(self, i: int) -> bytes:
        """Sample i's encoded image bytes, checked against the member checksum in the index."""
        s = self._shard_of(i)
        n = int(self._nbytes[i])
        try:
            data = os.pread(self._fd(s), n, int(self._offset[i]))
        except OSError as e:
            raise ShardError(f"{self.where(i)} cannot be read ({e.strerror})", FIX_SHARD) from None
        if len(data) != n:
            raise ShardError(f"{self.where(i)} is truncated ({len(data)} of {n} bytes)", FIX_SHARD)
        if xxhash.xxh3_64_intdigest(data) != int(self._xxh3[i]):
            raise ShardError(f"{self.where(i)} is corrupt (checksum mismatch)", FIX_SHARD)
        return data

    def stem(self, i: int) -> str:
        """Sample i's image member name without its extension (one row read from the index: keys are
        not kept in memory)."""
        s = self._shard_of(i)
        whole = len(self._key_columns) == 1 and len(self.shards) != 1
        column, row = (self._key_columns[0], i) if whole else (self._key_columns[s], i - int(self._starts[s]))
        return read_key(self._key_fd(column[0]), column, row).decode("utf-8", "replace")

    def key(self, i: int) -> str:
        """Sample i's key as webdataset names it (`__key__`: the stem up to the first dot of its basename)."""
        stem = self.stem(i)
        parts = split_name(stem + ".x")
        return stem if parts is None else parts[0]

    def where(self, i: int) -> str:
        """'SHARD.tar member STEM.jpg': the words an error line uses for sample i."""
        s = self._shard_of(i)
        try:
            stem = self.stem(i)
        except ShardError:
            stem = f"#{i - int(self._starts[s])}"
        return f"{shown(self.shards[s].name)} member {shown(f'{stem}.{EXTS[int(self._ext[i])]}')}"

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = OrderedDict()


def is_shard_set(obj: Any) -> bool:
    """A ShardSet-like split (what a plug-in factory may return as storage): labels, sizes, read, where.
    Asked by the plug-in resolver (torchlaunch.worker.plugins) and the plug-in reader alike, so it sits
    with ShardSet, below both."""
    return all(hasattr(obj, a) for a in ("labels", "sizes", "read", "where", "fingerprint"))
