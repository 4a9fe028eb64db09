"""The checkpoint-format seam: how a checkpoint's state becomes files in its step folder and back.

Why: the store (store.py) owns the commit protocol (hidden temp folder, atomic rename, COMMITTED.json,
verification, discovery, quarantine, retention); what the bytes inside the folder are is a format's
business. Today's format is one file written by rank 0 (single_file.py, `state.pt`); a sharded format
(torch.distributed.checkpoint) is one more module that registers here, and the store does not change.

The marker contract: `write` returns the fields the store records in COMMITTED.json, at least
"checksum" ("algorithm:hex") and "bytes" (the payload's size), plus whatever the format needs to check
its files later; `check`, `verify` and `load_into` are handed that marker back. A marker without a
"format" field was written by the single-file format (every marker before the seam).

What each rank saves is the format's decision: a plain format (CheckpointFormat) is written by rank 0
alone from the whole state; a sharded one (ShardedFormat, e.g. dcp.py) has every rank write its share
into the same temp folder (write_share), then rank 0 adds its own part and the marker fields (finish).
The Checkpointer runs that collectively (shares.py); the store's commit protocol is the same for both.
Loading is per rank and needs no peer: every rank loads the whole state (DDP replicates it).
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
from pathlib import Path
from typing import Any, Protocol

import xxhash

DEFAULT_FORMAT = "single_file"
"""The format the store writes unless told otherwise, and the one a marker without "format" names."""


class InvalidCheckpoint(Exception):
    """A checkpoint failed verification or safe loading; the message says why."""


CHECKSUM = "xxh3_128"
"""Content checksum of checkpoint files (every format may use it): detects truncation and bit flips (not an attacker: the safe
loader handles that) at ~20 GB/s, so verifying costs a few percent of a load, unlike sha256."""


def hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise InvalidCheckpoint(f"unknown checksum algorithm {algorithm!r}")


def file_checksum(path: Path, algorithm: str = CHECKSUM) -> str:
    """ "algorithm:hex" of a file, read in 8 MiB blocks."""
    h = hasher(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 23), b""):
            h.update(block)
    return f"{algorithm}:{h.hexdigest()}"


def create_new(path: Path) -> io.BufferedWriter:
    """A new file at `path` opened for writing; refused (FileExistsError / OSError ELOOP) when anything,
    a link included, already has that name: a format's file is never written through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "wb")


def expected_checksum(marker: dict[str, Any]) -> str:
    """The marker's checksum as "algorithm:hex" (markers may carry a bare "sha256" field)."""
    if "checksum" in marker:
        return str(marker["checksum"])
    return f"sha256:{marker['sha256']}"


class CheckpointFormat(Protocol):
    """One way of laying a state out in a checkpoint folder."""

    name: str

    def write(self, tmp_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Write `state` into the (empty, hidden) temp folder, durably (fsynced) before returning; the
        marker fields to record ("checksum", "bytes", and the format's own). `tmp_dir` names the folder
        the store created and holds open (pinned to its descriptor), not a path through the run dir, so
        files made under it land there even if RUN_DIR/checkpoints is swapped for a link meanwhile;
        create each file with create_new, so a link planted inside the folder is not followed either."""
        ...

    def check(self, directory: Path, marker: dict[str, Any]) -> str | None:
        """Cheap, reads no payload: why the folder's files cannot match the marker (missing, another
        size), or None. Discovery and every verify run it first."""
        ...

    def verify(self, directory: Path, marker: dict[str, Any]) -> str | None:
        """Read the payload: why its bytes do not match the marker (checksum), or None."""
        ...

    def files(self, directory: Path, marker: dict[str, Any]) -> list[Path]:
        """The payload files: a verified folder is not read again while these and the marker are unchanged."""
        ...

    def load_into(
        self, directory: Path, marker: dict[str, Any], state: dict[str, Any], map_location: Any
    ) -> dict[str, Any]:
        """Load the checkpoint into `state` and return it, raising InvalidCheckpoint when its bytes do
        not match the marker or cannot be loaded safely (a sharded format fills the tensors it is given
        in place; the single file returns its whole dict in `state`)."""
        ...


class ShardedFormat(CheckpointFormat, Protocol):
    """A format whose every rank writes a share of the state (`write` is the one-process case)."""

    def write_share(self, tmp_dir: Path, state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
        """Write this rank's share of `state` (every rank holds the same state) into the temp folder,
        durably; JSON-safe fields describing its files, which rank 0 hands to `finish`."""
        ...

    def finish(self, tmp_dir: Path, state: dict[str, Any], shares: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0, once every rank's share is durable: write rank 0's own part, return the marker fields
        (at least "checksum" and "bytes"); refuse (ValueError) shares that are not the format's files."""
        ...


def is_sharded(fmt: CheckpointFormat) -> bool:
    """Whether every rank writes a share of this format's checkpoints (else rank 0 writes them)."""
    return callable(getattr(fmt, "write_share", None))


_FORMATS: dict[str, CheckpointFormat] = {}
_ON_DEMAND = {"dcp": "torchlaunch.core.checkpoint.dcp"}
"""Built-in formats registered when first named (torch.distributed.checkpoint takes ~1.5 s to import,
which a run that never names the format should not pay at start-up)."""


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add a checkpoint format under its name; a name already taken is refused."""
    if fmt.name in _FORMATS:
        raise ValueError(f"checkpoint format {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format (tests that register a fake one); the default cannot be removed."""
    if name != DEFAULT_FORMAT:
        _FORMATS.pop(name, None)


def get_format(name: str | None = None) -> CheckpointFormat:
    """The registered format `name` (None: the default); KeyError when none is registered by that name."""
    name = name or DEFAULT_FORMAT
    if name not in _FORMATS and name in _ON_DEMAND:
        importlib.import_module(_ON_DEMAND[name])
    return _FORMATS[name]


def marker_format(marker: dict[str, Any]) -> str:
    """The format a commit marker names (markers before the seam name none: the single file)."""
    return str(marker.get("format", DEFAULT_FORMAT))


def unknown_format(marker: dict[str, Any]) -> str | None:
    """Why this build cannot read a marker's format (not registered: a newer torchlaunch, or a package
    that registers it was not imported), or None. Such a folder is likely valid: never quarantined."""
    name = marker_format(marker)
    if name in _FORMATS or name in _ON_DEMAND:
        return None
    return f"written in checkpoint format {name[:80]!r}, which this build does not know (known: {', '.join(known())})"


def known() -> list[str]:
    """Every format this build can read or write, registered or built in."""
    return [*_FORMATS, *(name for name in _ON_DEMAND if name not in _FORMATS)]
