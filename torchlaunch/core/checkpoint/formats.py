"""The checkpoint-format seam: how a checkpoint's state becomes files in its step folder and back.

Why: the store (store.py) owns the commit protocol (hidden temp folder, atomic rename, COMMITTED.json,
verification, discovery, quarantine, retention); what the bytes inside the folder are is a format's
business. Today's format is one file written by rank 0 (single_file.py, `state.pt`); a sharded format
(torch.distributed.checkpoint) is one more module that registers here, and the store does not change.

The marker contract: `write` returns the fields the store records in COMMITTED.json, at least
"checksum" ("algorithm:hex") and "bytes" (the payload's size), plus whatever the format needs to check
its files later; `check`, `verify` and `load_into` are handed that marker back. A marker without a
"format" field was written by the single-file format (every marker before the seam).
"""

from __future__ import annotations

import hashlib
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


_FORMATS: dict[str, CheckpointFormat] = {}


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
    return _FORMATS[name or DEFAULT_FORMAT]


def marker_format(marker: dict[str, Any]) -> str:
    """The format a commit marker names (markers before the seam name none: the single file)."""
    return str(marker.get("format", DEFAULT_FORMAT))


def unknown_format(marker: dict[str, Any]) -> str | None:
    """Why this build cannot read a marker's format (not registered: a newer torchlaunch, or a package
    that registers it was not imported), or None. Such a folder is likely valid: never quarantined."""
    name = marker_format(marker)
    if name in _FORMATS:
        return None
    return f"written in checkpoint format {name[:80]!r}, which this build does not know (known: {', '.join(_FORMATS)})"
