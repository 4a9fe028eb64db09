"""ShardSet: a folder of tar shards opened from its indexes, read by global sample index.

Opening reads the folder listing, one lstat per shard and the set index (`shards.idx`; the per-shard
indexes when it is absent or stale): nothing proportional to the number of samples but the index
arrays themselves, and no tar is scanned. A read is one os.pread on a cached descriptor plus an
xxh3_64 of the member, so a corrupt member is found where it is read, not trained on.

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

from torchlaunch.jobs.files import read_json
from torchlaunch.shards.errors import ShardError, shown
from torchlaunch.shards.fsio import open_regular, regular_size
from torchlaunch.shards.index import EXTS, REINDEX, SET_INDEX, Index, ShardInfo, index_path, load
from torchlaunch.shards.record import WRITE_PLAN

MAX_FDS = 64
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "torchlaunch-shards"
MANIFEST_VERSION = 1
FIX_SHARD = (
    "restore a good copy of the shard, or rewrite it from the source with python -m train.shards write "
    "(`python -m train.shards verify DIR` gives the command); re-indexing does not repair it"
)


def list_shards(folder: Path) -> list[str]:
    """The shard names of a split folder, sorted: the global sample order is shard by shard."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        raise ShardError(
            f"shard folder {folder} does not exist",
            "point data.root at the folder `python -m train.shards write` wrote",
        ) from None
    except NotADirectoryError:
        raise ShardError(f"{folder} is not a folder", "point data.root at a folder of .tar shards") from None
    except OSError as e:
        raise ShardError(f"shard folder {folder} cannot be listed ({e.strerror})", "check its permissions") from None
    return sorted(n for n in names if n.endswith(".tar") and not n.startswith("."))


def split_folder(folder: Path, split: str | None) -> Path:
    """A split folder: `folder` itself when it holds shards, else folder/split (train by default)."""
    if split is not None:
        return folder / split
    if not list_shards(folder) and (folder / "train").is_dir():
        return folder / "train"
    return folder


def read_manifest(root: Path) -> dict[str, Any] | None:
    """DIR/manifest.json if it is ours; ShardError when it is ours but unusable (or a symlink/FIFO)."""
    path = root / MANIFEST
    if regular_size(path, "manifest", "delete it or rewrite the set") is None:
        return None
    doc, why = read_json(path)
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


def load_indexes(folder: Path, names: list[str]) -> tuple[list[ShardInfo], dict[str, np.ndarray], Path | None]:
    """The shards' index columns: from the set index when it lists exactly these shards with these
    sizes, else from every per-shard index (the second value is the set index used, if any)."""
    sizes = {}
    for name in names:
        size = regular_size(folder / name, "shard", FIX_SHARD)
        sizes[name] = size
    set_path = folder / SET_INDEX
    if (
        regular_size(set_path, "set index", f"delete {set_path}; it is rebuilt by python -m train.shards index DIR")
        is not None
    ):
        whole = load(set_path, "set")
        if [s.name for s in whole.shards] == names and all(s.size == sizes[s.name] for s in whole.shards):
            return whole.shards, whole.columns, set_path
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
        parts.append(part)
    shards = [p.shards[0] for p in parts]
    columns = {c: np.concatenate([p.columns[c] for p in parts]) for c in parts[0].columns} if parts else {}
    return shards, columns, None


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
        set_index: Path | None,
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
        self._set_index = set_index
        self._keys: list[np.ndarray | None] | np.ndarray | None = None
        h = xxhash.xxh3_128()
        for s in shards:
            h.update(f"{s.name}\0{s.size}\0{s.xxh3}\0{s.count}\n".encode())
        h.update("\0".join(classes).encode())
        self.fingerprint = "shards-" + h.hexdigest()[:24]
        self._pid = -1
        self._fds: OrderedDict[int, int] = OrderedDict()

    @classmethod
    def open(cls, folder: str | Path, split: str | None = None) -> ShardSet:
        """Open a split folder (DIR/train), or DIR itself with `split` (default: DIR/train when DIR holds
        no shards). Reads only the listing and the indexes; ShardError names what is wrong and the fix."""
        root = Path(folder).expanduser()
        folder = split_folder(root, split)
        names = list_shards(folder)
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
            if isinstance(listed, list):
                missing = sorted(set(listed) - set(names))
                if missing:
                    raise ShardError(
                        f"shard {folder / missing[0]} is missing ({len(missing)} of {len(listed)} listed in the manifest)",
                        FIX_SHARD,
                    )
        orphans = sorted(
            n[: -len(".idx")] for n in os.listdir(folder) if n.endswith(".tar.idx") and n[: -len(".idx")] not in names
        )
        if orphans:
            raise ShardError(
                f"shard {folder / orphans[0]} is missing (its index {orphans[0]}.idx is present)", FIX_SHARD
            )
        shards, columns, set_index = load_indexes(folder, names)
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
        return cls(folder, shards, columns, classes, set_index)

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

    def _fd(self, s: int) -> int:
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
        fd = self._fds.get(s)
        if fd is not None:
            self._fds.move_to_end(s)
            return fd
        info = self.shards[s]
        path = self.folder / info.name
        fd, size = open_regular(path, "shard", FIX_SHARD)
        if size != info.size:
            os.close(fd)
            change = "truncated" if size < info.size else "longer than indexed"
            raise ShardError(f"shard {path} is {change} ({size} bytes, its index says {info.size})", FIX_SHARD)
        self._fds[s] = fd
        if len(self._fds) > MAX_FDS:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

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

    def key(self, i: int) -> str:
        """Sample i's key (read from the index on first use: keys are not kept in memory at open)."""
        s = self._shard_of(i)
        if self._set_index is not None:
            if self._keys is None:
                self._keys = load(self._set_index, "set").keys()
            keys = self._keys
            assert isinstance(keys, np.ndarray)
            return keys[i].decode("utf-8", "replace")
        if not isinstance(self._keys, list):
            self._keys = [None] * len(self.shards)
        if self._keys[s] is None:
            self._keys[s] = load(index_path(self.folder / self.shards[s].name), "shard").keys()
        return self._keys[s][i - int(self._starts[s])].decode("utf-8", "replace")

    def where(self, i: int) -> str:
        """'SHARD.tar member KEY.jpg': the words an error line uses for sample i."""
        s = self._shard_of(i)
        try:
            key = self.key(i)
        except ShardError:
            key = f"#{i - int(self._starts[s])}"
        return f"{shown(self.shards[s].name)} member {shown(f'{key}.{EXTS[int(self._ext[i])]}')}"

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = OrderedDict()
