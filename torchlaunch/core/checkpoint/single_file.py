"""The single-file checkpoint format, the first behind the seam (formats.py): rank 0 writes the whole
state with torch.save to one file, state.pt, checksummed on its way to disk; it is loaded with
weights_only=True while its checksum is computed alongside.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchlaunch.core.checkpoint.formats import (
    CHECKSUM,
    InvalidCheckpoint,
    create_new,
    expected_checksum,
    file_checksum,
    hasher,
    register_format,
)

STATE_FILE = "state.pt"


class _HashingFile(io.RawIOBase):
    """A write-only file that checksums every byte on its way to disk (no second pass)."""

    def __init__(self, fh: io.BufferedWriter) -> None:
        self.fh, self.hash, self.size = fh, hasher(CHECKSUM), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        return self.fh.write(view)

    def flush(self) -> None:
        self.fh.flush()

    @property
    def checksum(self) -> str:
        return f"{CHECKSUM}:{self.hash.hexdigest()}"


def write_hashed(path: Path, state: dict[str, Any]) -> tuple[int, str]:
    """torch.save straight to disk through a checksumming writer, then fsync; the file is created new,
    never through a link (create_new)."""
    with create_new(path) as raw:
        hashing = _HashingFile(raw)
        torch.save(state, hashing)
        raw.flush()
        os.fsync(raw.fileno())
    return hashing.size, hashing.checksum


CHECKSUM_MISMATCH = "checksum mismatch (corrupted bytes)"


def _in_thread(fn: Callable[..., str], *args: Any) -> Callable[[], str]:
    """Start fn(*args) in a thread; the returned callable joins it and returns (or raises) its outcome."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            outcome["error"] = e

    thread = threading.Thread(target=run, name="checkpoint-verify", daemon=True)
    thread.start()

    def result() -> str:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return result


def safe_load(file: Path, map_location: str | torch.device) -> Any:
    """torch.load(weights_only=True), its refusals and read errors as InvalidCheckpoint."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "Unsupported" in ln or "WeightsUnpickler" in ln]
        first = lines[0].split(". Please")[0] if lines else (str(e).strip().splitlines() or ["unsupported content"])[0]
        raise InvalidCheckpoint(f"refused by the safe loader (weights_only=True), nothing executed: {first}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise InvalidCheckpoint(f"cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class SingleFile:
    """One torch.save file, STATE_FILE; the marker records its size ("bytes") and checksum."""

    name = "single_file"

    def write(self, tmp_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
        size, digest = write_hashed(tmp_dir / STATE_FILE, state)
        return {"checksum": digest, "bytes": size}

    def check(self, directory: Path, marker: dict[str, Any]) -> str | None:
        if not (directory / STATE_FILE).is_file():
            return "state file missing"
        size = (directory / STATE_FILE).stat().st_size
        if size != int(marker["bytes"]):
            return f"size {size} bytes, expected {marker['bytes']} (truncated?)"
        return None

    def verify(self, directory: Path, marker: dict[str, Any]) -> str | None:
        expected = expected_checksum(marker)
        try:
            actual = file_checksum(directory / STATE_FILE, expected.partition(":")[0])
        except OSError as e:
            return f"cannot be read: {e.strerror or e}"
        return CHECKSUM_MISMATCH if actual != expected else None

    def files(self, directory: Path, marker: dict[str, Any]) -> list[Path]:
        return [directory / STATE_FILE]

    def load_into(
        self, directory: Path, marker: dict[str, Any], state: dict[str, Any], map_location: Any
    ) -> dict[str, Any]:
        """The checksum is computed in a thread while torch.load reads the same file (xxhash and hashlib
        release the GIL while hashing), so verifying adds little to a load when a core is free. The state
        is returned only when the checksum matches; on a mismatch the loaded object (or the loader's error)
        is discarded and the mismatch is reported, as when the file was verified first. Parsing the bad
        bytes meanwhile is safe: weights_only=True is what refuses crafted files in the first place.
        Anything but a dict is returned as it is, for the store to refuse."""
        expected = expected_checksum(marker)
        algorithm = expected.partition(":")[0]
        hasher(algorithm)  # an unknown algorithm fails before any work
        checksum = _in_thread(file_checksum, directory / STATE_FILE, algorithm)
        try:
            loaded = safe_load(directory / STATE_FILE, map_location)
        except BaseException:
            if checksum() != expected:
                raise InvalidCheckpoint(CHECKSUM_MISMATCH) from None
            raise
        if checksum() != expected:
            raise InvalidCheckpoint(CHECKSUM_MISMATCH)
        if not isinstance(loaded, dict):
            return loaded
        state.update(loaded)
        return state


register_format(SingleFile())
