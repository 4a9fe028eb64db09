"""The `dcp` checkpoint format: torch.distributed.checkpoint, every rank writing its share.

Layout of a step folder: `__R_0.distcp` + `__R.metadata` per rank R that holds a share (DCP's files,
written by DCP's FileSystemWriter without rank coordination), `rest.pt` (rank 0: everything that is
not a shared tensor, the shared tensors replaced by placeholders naming their key, shape and dtype), and
COMMITTED.json, which records the size and xxh3-128 checksum of every file.

What each rank writes: with DDP every rank holds the whole replicated state, so "its share" is a
deterministic split of the state's tensors (largest first, each to the rank with the fewest bytes so
far): each rank writes ~1/N of the bytes. The per-rank RNG states (the envelope's "rng"), progress,
config and every other non-tensor stay in rank 0's rest.pt. A load reads every share whatever the
world size now (each rank needs the whole state), so a checkpoint saved on N ranks loads on any M.

Security: nothing is unpickled unverified or unrestricted. DCP's `.metadata` files are pickles (torch
2.14's FileSystemReader.read_metadata calls pickle.load); this module never lets DCP read them. It
reads each one's bytes itself, checks them against the checksum rank 0 recorded in the marker, then
unpickles them with a restricted unpickler that only builds DCP's metadata classes, torch dtypes, sizes,
layouts and paths (a forged file naming anything else is refused, nothing executed), and refuses any
entry that is not a tensor (DCP loads byte entries with torch.load(weights_only=False)). Tensor data
is read by DCP with torch.load(weights_only=True); rest.pt with weights_only=True too. Every file is
created new inside the pinned temp folder (create_new: O_EXCL | O_NOFOLLOW) and opened O_NOFOLLOW when
read, so a link planted in the folder is neither written nor read through.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import warnings
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as torch_dcp
import xxhash
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter, _StorageInfo

from torchlaunch import rundir
from torchlaunch.core.checkpoint.formats import (
    CHECKSUM,
    InvalidCheckpoint,
    create_new,
    expected_checksum,
    hasher,
    register_format,
)
from torchlaunch.core.checkpoint.single_file import CHECKSUM_MISMATCH, safe_load, write_hashed

REST_FILE = "rest.pt"
KEPT_WHOLE = ("rng",)
"""Top-level keys whose tensors stay in rank 0's rest.pt (every rank's RNG states: small, per rank)."""
PLACEHOLDER = "__torchlaunch_dcp_tensor__"
SHARE_FILE = re.compile(r"__(\d{1,6})(_\d{1,6}\.distcp|\.metadata)", re.ASCII)
MAX_FILES = 100_000


def _open_nofollow(path: Path) -> IO[bytes]:
    """`path` opened for reading, refused (ELOOP) when its last component is a link."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


def _describe(path: Path) -> list[Any]:
    """[bytes, "algorithm:hex"] of a file, read without following a link."""
    h, size = hasher(CHECKSUM), 0
    with _open_nofollow(path) as fh:
        for block in iter(lambda: fh.read(1 << 23), b""):
            h.update(block)
            size += len(block)
    return [size, f"{CHECKSUM}:{h.hexdigest()}"]


def _combined(files: dict[str, list[Any]]) -> str:
    """The marker's one checksum: over every file's name and checksum, in name order."""
    text = "\n".join(f"{name} {files[name][1]}" for name in sorted(files))
    return f"{CHECKSUM}:{xxhash.xxh3_128(text.encode()).hexdigest()}"


class _NoFollowFS(FileSystem):
    """DCP's file system, creating files new (never through a link) and reading without following one."""

    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        if mode == "wb":
            return create_new(Path(path))
        if mode == "rb":
            return _open_nofollow(Path(path))
        raise ValueError(f"unexpected file mode {mode!r}")


class _ShareWriter(FileSystemWriter):
    """DCP's writer for one rank's share: files named after the rank (`__R_*.distcp`, `__R.metadata`)
    with no coordination between ranks (the Checkpointer agrees on the outcome itself)."""

    def __init__(self, path: Path, share: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.fs = _NoFollowFS()
        self.share = share

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.rank, self.use_collectives = self.share, False

    def _metadata_exists(self) -> bool:
        return self.fs.exists(self._get_metadata_path(self.share))


class _VerifiedReader(FileSystemReader):
    """DCP's reader handed the metadata this module verified and unpickled (never pickle.load)."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(path)
        self.fs = _NoFollowFS()
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return self._metadata


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and nothing else (torch dtypes by name): a forged .metadata that
    names any other callable is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def _read_metadata(directory: Path, name: str, expected: str, shared_files: set[str]) -> dcp_metadata.Metadata:
    """One share's .metadata: its bytes checked against the marker's checksum, then unpickled restricted."""
    with _open_nofollow(directory / name) as fh:
        raw = fh.read()
    h = hasher(expected.partition(":")[0])
    h.update(raw)
    if f"{expected.partition(':')[0]}:{h.hexdigest()}" != expected:
        raise InvalidCheckpoint(f"{CHECKSUM_MISMATCH} in {name}")
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - any failure of a forged or damaged pickle is a refusal
        raise InvalidCheckpoint(f"{name} refused, nothing executed: {str(e)[:200]}") from None
    if not isinstance(meta, dcp_metadata.Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise InvalidCheckpoint(f"{name} is not DCP metadata")
    for key, entry in meta.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise InvalidCheckpoint(f"{name}: entry {str(key)[:80]!r} is not a tensor (refused unread)")
    if not isinstance(meta.storage_data, dict):
        raise InvalidCheckpoint(f"{name} holds no storage map")
    for where in meta.storage_data.values():  # DCP opens FOLDER / relative_path: only this share's files
        if not (
            isinstance(where, _StorageInfo)
            and isinstance(where.relative_path, str)
            and where.relative_path in shared_files
            and type(where.offset) is int
            and type(where.length) is int
        ):
            raise InvalidCheckpoint(f"{name} points at data outside the checkpoint's share files")
    return meta


def _shared(state: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """(the state with its shared tensors replaced by placeholders, [(key, tensor)] in traversal order)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def strip(obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            key = "/".join(path)
            leaves.append((key, obj.detach()))
            return {PLACEHOLDER: key, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
        if isinstance(obj, dict):
            return {k: strip(v, (*path, str(k))) for k, v in obj.items()}
        if isinstance(obj, list):
            return [strip(v, (*path, str(i))) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(strip(v, (*path, str(i))) for i, v in enumerate(obj))
        return obj

    rest = {k: (v if k in KEPT_WHOLE else strip(v, (str(k),))) for k, v in state.items()}
    if len({k for k, _ in leaves}) != len(leaves):
        raise ValueError("two tensors of the state have the same key path (a str and an int key alike?)")
    return rest, leaves


def _keys_digest(share: dict[str, torch.Tensor]) -> str:
    """Which tensors a share holds (their keys, shapes and dtypes), so rank 0 can check every rank
    wrote the share its split gives that rank."""
    text = "\n".join(f"{k} {list(t.shape)} {t.dtype}" for k, t in sorted(share.items()))
    return xxhash.xxh3_64(text.encode()).hexdigest()


def owners(leaves: list[tuple[str, torch.Tensor]], world_size: int) -> list[int]:
    """The rank that writes each tensor: largest first, each to the rank with the fewest bytes so far
    (ties: the earlier tensor, the lower rank), so every rank writes ~1/N and all ranks agree."""
    load = [0] * world_size
    owner = [0] * len(leaves)
    for i in sorted(range(len(leaves)), key=lambda i: (-leaves[i][1].nbytes, i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += leaves[i][1].nbytes
    return owner


def _marker_files(marker: dict[str, Any]) -> dict[str, list[Any]]:
    """The marker's file table, every name one of this format's (no path, no link target), or ValueError."""
    files = marker.get("files")
    if not isinstance(files, dict) or len(files) > MAX_FILES or REST_FILE not in files:
        raise ValueError("the marker names no dcp files")
    for name, entry in files.items():
        ok_name = name == REST_FILE or SHARE_FILE.fullmatch(name) is not None
        ok_entry = (
            isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and entry[0] >= 0
            and isinstance(entry[1], str)
        )
        if not (ok_name and ok_entry):
            raise ValueError(f"the marker's file entry {str(name)[:80]!r} is not a dcp file")
    return files


class DistributedCheckpoint:
    """DCP shares per rank plus rank 0's rest.pt; the marker records every file's size and checksum."""

    name = "dcp"

    def write(self, tmp_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
        return self.finish(tmp_dir, state, [self.write_share(tmp_dir, state, 0, 1)])

    def write_share(self, tmp_dir: Path, state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
        _, leaves = _shared(state)
        mine = {key: t for (key, t), r in zip(leaves, owners(leaves, world_size), strict=True) if r == rank}
        if not mine:
            return {"files": {}, "tensors": _keys_digest(mine)}
        with warnings.catch_warnings():  # "torch.distributed ... assuming ... a single process": meant so
            warnings.simplefilter("ignore", UserWarning)
            torch_dcp.save(mine, storage_writer=_ShareWriter(tmp_dir, rank), no_dist=True, use_collectives=False)
        names = [p.name for p in tmp_dir.iterdir() if (m := SHARE_FILE.fullmatch(p.name)) and int(m[1]) == rank]
        files = {name: _describe(tmp_dir / name) for name in sorted(names)}
        return {"files": files, "tensors": _keys_digest(mine)}

    def finish(self, tmp_dir: Path, state: dict[str, Any], shares: list[dict[str, Any]]) -> dict[str, Any]:
        rest, leaves = _shared(state)
        split = owners(leaves, len(shares))
        for rank, share in enumerate(shares):
            wrote = _keys_digest({key: t for (key, t), r in zip(leaves, split, strict=True) if r == rank})
            if share.get("tensors") != wrote:
                raise ValueError(f"rank {rank} wrote other tensors than rank 0's split gives it (another model?)")
        size, digest = write_hashed(tmp_dir / REST_FILE, rest)
        files: dict[str, list[Any]] = {REST_FILE: [size, digest]}
        for rank, share in enumerate(shares):
            for name, entry in (share.get("files") or {}).items():
                m = SHARE_FILE.fullmatch(str(name))
                if m is None or int(m[1]) != rank or name in files:
                    raise ValueError(f"rank {rank}'s share names a file {str(name)[:80]!r} it does not own")
                files[name] = entry
        _marker_files({"files": files})
        rundir.fsync_dir(tmp_dir)  # the share files' names are durable before the folder is renamed into place
        total = sum(entry[0] for entry in files.values())
        return {"checksum": _combined(files), "bytes": total, "files": files, "shares": len(shares)}

    def check(self, directory: Path, marker: dict[str, Any]) -> str | None:
        try:
            files = _marker_files(marker)
        except ValueError as e:
            return str(e)
        if _combined(files) != expected_checksum(marker):
            return "its file table does not match the marker's checksum"
        for name, (size, _) in files.items():
            try:
                st = os.lstat(directory / name)
            except OSError:
                return f"{name} missing"
            if not stat.S_ISREG(st.st_mode):
                return f"{name} is not a regular file (a link?)"
            if st.st_size != size:
                return f"{name}: size {st.st_size} bytes, expected {size} (truncated?)"
        return None

    def verify(self, directory: Path, marker: dict[str, Any]) -> str | None:
        problem = self.check(directory, marker)
        if problem is not None:
            return problem
        for name, (_, expected) in _marker_files(marker).items():
            try:
                h = hasher(expected.partition(":")[0])
                with _open_nofollow(directory / name) as fh:
                    for block in iter(lambda: fh.read(1 << 23), b""):
                        h.update(block)
            except InvalidCheckpoint as e:
                return str(e)
            except OSError as e:
                return f"{name} cannot be read: {e.strerror or e}"
            if f"{expected.partition(':')[0]}:{h.hexdigest()}" != expected:
                return f"{CHECKSUM_MISMATCH} in {name}"
        return None

    def files(self, directory: Path, marker: dict[str, Any]) -> list[Path]:
        try:
            return [directory / name for name in sorted(_marker_files(marker))]
        except ValueError:
            return [directory / REST_FILE]

    def load_into(
        self, directory: Path, marker: dict[str, Any], state: dict[str, Any], map_location: Any
    ) -> dict[str, Any]:
        """Every file verified first (the .metadata bytes again as they are unpickled), then rest.pt
        loaded with weights_only=True, its placeholders filled by DCP from every share."""
        problem = self.verify(directory, marker)
        if problem is not None:
            raise InvalidCheckpoint(problem)
        files = _marker_files(marker)
        rest = safe_load(directory / REST_FILE, "cpu")
        if not isinstance(rest, dict):
            return rest
        merged = dcp_metadata.Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
        for name in sorted(n for n in files if n.endswith(".metadata")):
            meta = _read_metadata(directory, name, files[name][1], {n for n in files if n.endswith(".distcp")})
            merged.state_dict_metadata.update(meta.state_dict_metadata)
            merged.storage_data.update(meta.storage_data)
        targets: dict[str, torch.Tensor] = {}
        filled = _fill(rest, merged, targets)
        if targets:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    torch_dcp.load(targets, storage_reader=_VerifiedReader(directory, merged), no_dist=True)
            except Exception as e:  # noqa: BLE001 - DCP wraps every read failure (CheckpointException)
                raise InvalidCheckpoint(f"cannot be read: {str(e).splitlines()[0][:300] if str(e) else e}") from None
        if str(map_location) != "cpu":
            for key, tensor in targets.items():
                targets[key] = tensor.to(map_location)
            filled = _fill(rest, merged, targets)
        state.update(filled)
        return state


def _fill(rest: dict[str, Any], meta: dcp_metadata.Metadata, targets: dict[str, torch.Tensor]) -> dict[str, Any]:
    """rest.pt's state with each placeholder replaced by its tensor in `targets` (allocated there, empty,
    with the shape and dtype that the placeholder and the verified metadata agree on)."""

    def place(obj: Any) -> Any:
        if isinstance(obj, dict) and PLACEHOLDER in obj:
            key, shape, dtype = obj.get(PLACEHOLDER), obj.get("shape"), getattr(torch, str(obj.get("dtype")), None)
            entry = meta.state_dict_metadata.get(key) if isinstance(key, str) else None
            if entry is None or not isinstance(dtype, torch.dtype) or not isinstance(shape, list):
                raise InvalidCheckpoint(f"rest.pt names a tensor {str(key)[:80]!r} no share holds")
            if list(entry.size) != shape or entry.properties.dtype != dtype:
                raise InvalidCheckpoint(f"rest.pt and the shares disagree on tensor {key[:80]!r}")
            if key not in targets:
                targets[key] = torch.empty(shape, dtype=dtype)
            return targets[key]
        if isinstance(obj, dict):
            return {k: v if k in KEPT_WHOLE and obj is rest else place(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [place(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(place(v) for v in obj)
        return obj

    return place(rest)


register_format(DistributedCheckpoint())
