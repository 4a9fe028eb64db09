"""The checkpoint-format seam (torchlaunch/core/checkpoint/formats.py): the store's commit marker,
verification, newest-valid discovery, quarantine and retention work for any registered format, shown
with a fake two-file JSON format defined here."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.checkpoint import dcp
from torchlaunch.core.dist import DistContext

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


# ---------------------------------------------------------------------------------------------
# dcp (torchlaunch/core/checkpoint/dcp.py): torch.distributed.checkpoint, each rank its share


def trained_state(step: int) -> dict[str, Any]:
    """A worker-like state: a model and AdamW state (tensors, shared), RNG states and progress (rank 0's)."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    return {
        "format_version": ckpt.FORMAT_VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "progress": {"global_step": step, "last_val": {}},
        "rng": [{"torch": torch.get_rng_state(), "python": [3, [1, 2], None]}],
    }


def assert_same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


def dcp_commit(root: Path, step: int) -> Path:
    return ckpt.write_checkpoint(root, step, trained_state(step), {}, format_name="dcp").path


def test_dcp_writes_every_file_checksummed_and_loads_the_state_bit_for_bit(tmp_path: Path) -> None:
    path = dcp_commit(tmp_path / "checkpoints", 3)
    marker = ckpt.read_marker(path)
    assert marker["format"] == "dcp" and marker["shares"] == 1
    assert sorted(marker["files"]) == ["__0.metadata", "__0_0.distcp", "rest.pt"]
    assert sorted(p.name for p in path.iterdir()) == sorted([*marker["files"], ckpt.MARKER_FILE])
    assert marker["bytes"] == sum(size for size, _ in marker["files"].values())
    ckpt.store._VERIFIED.clear()
    assert ckpt.verify(path) is None
    assert_same_state(ckpt.load_state(path), trained_state(3))


def test_dcp_splits_the_tensors_over_the_ranks_by_size_and_any_world_size_loads_them(tmp_path: Path) -> None:
    state = trained_state(4)
    _, leaves = dcp._shared(state)
    assert [k for k, _ in leaves][:2] == ["model/0.weight", "model/0.bias"]  # rng stays in rest.pt
    for world in (2, 3):
        owner = dcp.owners(leaves, world)
        load = [sum(t.nbytes for (_, t), r in zip(leaves, owner, strict=True) if r == rank) for rank in range(world)]
        assert max(load) - min(load) <= max(t.nbytes for _, t in leaves)  # ~1/N each
    fmt = ckpt.get_format("dcp")
    folder = tmp_path / "step-000000004"
    folder.mkdir()
    shares = [fmt.write_share(folder, state, rank, 3) for rank in range(3)]  # 3 ranks, each its share
    fields = fmt.finish(folder, state, shares)
    assert fields["shares"] == 3 and {n for n in fields["files"] if n.endswith(".metadata")} == {
        "__0.metadata",
        "__1.metadata",
        "__2.metadata",
    }
    assert_same_state(fmt.load_into(folder, fields, {}, "cpu"), state)  # one process reads all 3 shares
    wrong = dict(shares[1], tensors="0")
    with pytest.raises(ValueError, match="rank 1 wrote other tensors"):
        fmt.finish(tmp_path, state, [shares[0], wrong, shares[2]])


def test_a_corrupted_dcp_share_is_quarantined_and_the_previous_resumed(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    older, newer = dcp_commit(root, 1), dcp_commit(root, 2)
    share = newer / "__0_0.distcp"
    data = bytearray(share.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit flip: same size
    share.write_bytes(bytes(data))
    ckpt.store._VERIFIED.clear()
    assert ckpt.verify(newer) == f"{ckpt.CHECKSUM_MISMATCH} in __0_0.distcp"
    skipped: list[str] = []
    path, state = ckpt.find_latest(root, on_skip=skipped.append, move_invalid=True)
    assert path == older and state["progress"]["global_step"] == 1
    assert not newer.exists() and (root / ckpt.QUARANTINE_DIR / newer.name / "__0_0.distcp").is_file()
    assert "checksum mismatch (corrupted bytes) in __0_0.distcp" in skipped[0]


def test_a_link_planted_in_a_dcp_folder_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = dcp_commit(root, 1)
    outside = tmp_path / "elsewhere.distcp"
    (path / "__0_0.distcp").rename(outside)
    (path / "__0_0.distcp").symlink_to(outside)  # the same bytes, behind a link
    ckpt.store._VERIFIED.clear()
    assert ckpt.verify(path) == "__0_0.distcp is not a regular file (a link?)"
    with pytest.raises(ckpt.InvalidCheckpoint, match="not a regular file"):
        ckpt.load_state(path)
    fmt = ckpt.get_format("dcp")
    folder = tmp_path / "tmp-folder"
    folder.mkdir()
    target = tmp_path / "target"
    (folder / "__0_0.distcp").symlink_to(target)  # planted before the write: refused, nothing written there
    with pytest.raises(OSError):
        fmt.write(folder, trained_state(1))
    assert not target.exists()


def forge_metadata(folder: Path, data: bytes) -> None:
    """Replace the folder's __0.metadata with `data` and forge its marker to match (checksums, sizes)."""
    (folder / "__0.metadata").write_bytes(data)
    marker = ckpt.read_marker(folder)
    marker["files"]["__0.metadata"] = [len(data), ckpt.file_checksum(folder / "__0.metadata")]
    marker["checksum"], marker["bytes"] = dcp._combined(marker["files"]), sum(s for s, _ in marker["files"].values())
    (folder / ckpt.MARKER_FILE).write_text(json.dumps(marker))
    ckpt.store._VERIFIED.clear()


def test_a_forged_dcp_metadata_is_refused_without_executing_code(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    good = dcp_commit(root, 1)
    evil = dcp_commit(root, 2)
    canary = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {canary}",))

    forge_metadata(evil, pickle.dumps(Exploit()))
    assert ckpt.verify(evil) is None  # the bytes match the (forged) marker: only the unpickler stands
    with pytest.raises(ckpt.InvalidCheckpoint, match=r"__0.metadata refused, nothing executed: posix.system"):
        ckpt.load_state(evil)
    skipped: list[str] = []
    assert ckpt.find_latest(root, on_skip=skipped.append)[0] == good
    assert not canary.exists() and "nothing executed" in skipped[0]


def test_a_dcp_metadata_pointing_outside_its_shares_is_refused(tmp_path: Path) -> None:
    path = dcp_commit(tmp_path / "checkpoints", 1)
    meta = pickle.loads((path / "__0.metadata").read_bytes())  # this test's own file: trusted
    for where in meta.storage_data.values():
        where.relative_path = "../../../etc/hostname"
    forge_metadata(path, pickle.dumps(meta))
    with pytest.raises(ckpt.InvalidCheckpoint, match="points at data outside the checkpoint's share files"):
        ckpt.load_state(path)


def test_the_checkpointer_saves_dcp_synchronously_and_any_checkpointer_loads_it(tmp_path: Path) -> None:
    """One process (no group): the collective write degenerates to rank 0's share; the save commits
    before it returns (dcp saves are synchronous); a Checkpointer set to the single file loads it."""
    state = trained_state(5)
    payload = {k: v for k, v in state.items() if k != "rng"}
    saver = ckpt.Checkpointer(DistContext(), tmp_path / "checkpoints", 2, "formats-test", format_name="dcp")
    assert saver.wants_payload
    info = saver.save(5, payload)  # not asked to be synchronous
    assert info is not None and ckpt.read_marker(info.path)["format"] == "dcp"
    loaded = ckpt.Checkpointer(DistContext(), tmp_path / "checkpoints", 2, "formats-test").load_latest(restore=False)
    assert loaded is not None and loaded.step == 5
    assert_same_state({k: loaded.state[k] for k in payload}, payload)
