"""The checkpoint-format seam (torchlaunch/core/checkpoint/formats.py): the store's commit marker,
verification, newest-valid discovery, quarantine and retention work for any registered format, shown
with a fake two-file JSON format defined here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from torchlaunch.core import checkpoint as ckpt

FAKE = "two_json_parts"


class TwoParts:
    """The state split over two JSON files (keys alternately), each checksummed; the marker's checksum
    is over the two files' checksums, its bytes their total size."""

    name = FAKE
    PARTS = ("part-0.json", "part-1.json")

    def write(self, tmp_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
        keys = sorted(state)
        for n, part in enumerate(self.PARTS):
            (tmp_dir / part).write_text(json.dumps({k: state[k] for k in keys[n::2]}))
        sums = [ckpt.file_checksum(tmp_dir / p) for p in self.PARTS]
        return {"checksum": self._combined(sums), "bytes": self._size(tmp_dir), "part_checksums": sums}

    def _size(self, directory: Path) -> int:
        return sum((directory / p).stat().st_size for p in self.PARTS)

    @staticmethod
    def _combined(sums: list[str]) -> str:
        return f"{ckpt.CHECKSUM}:{xxhash.xxh3_128('|'.join(sums).encode()).hexdigest()}"

    def check(self, directory: Path, marker: dict[str, Any]) -> str | None:
        if not all((directory / p).is_file() for p in self.PARTS):
            return "a part is missing"
        size = self._size(directory)
        return None if size == int(marker["bytes"]) else f"parts hold {size} bytes, expected {marker['bytes']}"

    def verify(self, directory: Path, marker: dict[str, Any]) -> str | None:
        sums = [ckpt.file_checksum(directory / p) for p in self.PARTS]
        if sums != marker["part_checksums"] or self._combined(sums) != marker["checksum"]:
            return ckpt.CHECKSUM_MISMATCH
        return None

    def files(self, directory: Path, marker: dict[str, Any]) -> list[Path]:
        return [directory / p for p in self.PARTS]

    def load_into(
        self, directory: Path, marker: dict[str, Any], state: dict[str, Any], map_location: Any
    ) -> dict[str, Any]:
        problem = self.verify(directory, marker)
        if problem is not None:
            raise ckpt.InvalidCheckpoint(problem)
        for p in self.PARTS:
            state.update(json.loads((directory / p).read_text()))
        return state


@pytest.fixture
def fake() -> Iterator[TwoParts]:
    fmt = ckpt.register_format(TwoParts())
    try:
        yield fmt
    finally:
        ckpt.unregister_format(FAKE)


def state_at(step: int) -> dict[str, Any]:
    return {"format_version": ckpt.FORMAT_VERSION, "step": step, "weights": [step, step + 1], "note": "x" * step}


def commit(root: Path, step: int, val_acc: float = 0.0) -> Path:
    return ckpt.write_checkpoint(root, step, state_at(step), {"val_acc": val_acc}, format_name=FAKE).path


def test_a_second_format_commits_verifies_and_loads_through_the_store(fake: TwoParts, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = commit(root, 3)
    assert sorted(p.name for p in path.iterdir()) == [ckpt.MARKER_FILE, *TwoParts.PARTS]  # no state.pt
    marker = ckpt.read_marker(path)
    assert marker["format"] == FAKE and marker["step"] == 3 and len(marker["part_checksums"]) == 2
    assert ckpt.verify(path) is None and ckpt.latest_valid(root) == path
    assert ckpt.load_state(path) == state_at(3)
    (path / TwoParts.PARTS[1]).write_text((path / TwoParts.PARTS[1]).read_text().replace("x", "y"))  # same size
    ckpt.store._VERIFIED.clear()  # a fresh process: nothing verified yet
    assert ckpt.verify(path) == ckpt.CHECKSUM_MISMATCH
    with pytest.raises(ckpt.InvalidCheckpoint, match="checksum mismatch"):
        ckpt.load_state(path)


def test_latest_valid_and_retention_work_through_the_seam(fake: TwoParts, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    paths = {step: commit(root, step, val_acc=0.9 if step == 1 else 0.1) for step in (1, 2, 3, 4)}
    (paths[4] / TwoParts.PARTS[0]).unlink()  # the newest lost a part: the format's check says so
    skipped: list[tuple[Path, str]] = []
    assert ckpt.latest_valid(root, on_skip=lambda p, r: skipped.append((p, r))) == paths[3]
    assert skipped == [(paths[4], "a part is missing")]
    warnings: list[str] = []
    removed = ckpt.retain(root, keep=1, committed=paths[3], on_warn=warnings.append)
    assert removed == [paths[2]]  # step 1 stays as the best by val_acc, step 4 is quarantined, not counted
    assert paths[1].is_dir() and paths[3].is_dir() and not paths[4].exists()
    assert (root / ckpt.QUARANTINE_DIR / paths[4].name).is_dir() and "a part is missing" in warnings[0]


def test_a_folder_of_an_unregistered_format_is_kept_and_refused_not_quarantined(fake: TwoParts, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    older = ckpt.write_checkpoint(root, 1, state_at(1), {}).path  # the default single file
    newer = commit(root, 2)
    ckpt.unregister_format(FAKE)  # as in a process that never imported the package registering it
    assert "does not know" in (ckpt.verify(newer) or "")
    assert ckpt.latest_valid(root) == older
    with pytest.raises(ckpt.NewerFormat, match=f"checkpoint format '{FAKE}'"):
        ckpt.load_state(newer)
    assert ckpt.retain(root, keep=1, committed=older) == [] and newer.is_dir()  # likely valid: never moved


def test_the_single_file_is_the_default_format_and_its_markers_name_none(tmp_path: Path) -> None:
    path = ckpt.write_checkpoint(tmp_path / "checkpoints", 5, state_at(5), {}).path
    assert ckpt.get_format().name == ckpt.DEFAULT_FORMAT == "single_file"
    assert (path / ckpt.STATE_FILE).is_file() and "format" not in ckpt.read_marker(path)  # markers as before
    with pytest.raises(ValueError, match="already registered"):
        ckpt.register_format(ckpt.SingleFile())
