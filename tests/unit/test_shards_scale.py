"""Opening a shard set costs no file per shard (issue 38, item 7): counted structurally, never timed.

The sets are bench/shards_scale.py's generator at small sizes (real indexes and manifest, sparse
shards, one real JPEG per split); timings live in that benchmark (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bench.shards_scale import first_jpeg, write_split
from torchlaunch.config import DataConfig
from torchlaunch.data.checks import check_data
from torchlaunch.data.shards import ShardError, ShardSet
from torchlaunch.data.shards.index import INDEX_SUFFIX, SET_INDEX

pytestmark = pytest.mark.timeout(120)


def make_set(root: Path, shards: int, classes: int = 10, per_shard: int = 3) -> Path:
    """A set as the writer leaves it: train/ with `shards` shards, val/ with 2, and manifest.json."""
    jpeg = first_jpeg()
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", shards), ("val", 2)):
        names = write_split(root / split, split, n * per_shard, n, jpeg, rng, classes)
        splits[split] = {"count": n * per_shard, "shards": names, "index": SET_INDEX}
    names = [f"n{c:08d}" for c in range(classes)]
    manifest = {"format": "torchlaunch-shards", "version": 1, "classes": names, "splits": splits}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the per-file system calls an open could make per shard."""
    counts = {"open": 0, "lstat": 0, "stat": 0}
    for name in counts:
        real = getattr(os, name)

        def counted(*args, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(os, name, counted)
    return counts


def test_open_and_precheck_cost_no_file_per_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same number of opens and stats for 20 shards and for 200: the old open lstat'ed every shard
    (100,000 stats at ImageNet scale), and read every key of the set to name sample 0."""
    small, large = make_set(tmp_path / "small", 20), make_set(tmp_path / "large", 200)
    seen = {}
    for root in (small, large):
        counts = count_calls(monkeypatch)
        ss = ShardSet.open(root / "train")
        check_data(DataConfig(name="shards", root=str(root)), local=True)
        seen[root.name] = dict(counts)
        monkeypatch.undo()
        assert len(ss) == (20 if root is small else 200) * 3
    assert seen["small"] == seen["large"], seen
    assert seen["large"]["open"] + seen["large"]["lstat"] + seen["large"]["stat"] < 40, seen


def test_orphan_index_is_still_found_among_many(tmp_path: Path) -> None:
    """The set-based scan finds an index without its shard, and ignores dot-files and other names."""
    root = make_set(tmp_path / "set", 120)
    train = root / "train"
    (train / ".hidden.tar").write_bytes(b"")
    (train / "notes.txt").write_text("x")
    os.rename(train / "train-000100.tar", tmp_path / "away.tar")
    with pytest.raises(ShardError) as e:
        ShardSet.open(train)
    assert "train-000100.tar is missing" in str(e.value) and "\n" not in str(e.value)


def test_a_symlink_in_a_shards_place_is_refused_at_open(tmp_path: Path) -> None:
    """No stat per shard, but the listing's entry types still refuse a symlink before any read."""
    root = make_set(tmp_path / "set", 30)
    train = root / "train"
    os.rename(train / "train-000007.tar", tmp_path / "elsewhere.tar")
    (train / "train-000007.tar").symlink_to(tmp_path / "elsewhere.tar")
    with pytest.raises(ShardError, match=r"train-000007\.tar is a symlink"):
        ShardSet.open(train)


def test_a_replaced_shard_is_caught_when_read(tmp_path: Path) -> None:
    """A shard whose size no longer matches the set index (no stat at open) is named at its first read."""
    root = make_set(tmp_path / "set", 5)
    os.truncate(root / "train" / "train-000000.tar", 4096)
    ss = ShardSet.open(root / "train")
    with pytest.raises(ShardError, match=r"train-000000\.tar is truncated .*re-indexing does not repair it"):
        ss.read(0)


def test_a_manifest_over_256_kb_opens(tmp_path: Path) -> None:
    """ImageNet-21k's 21,841 class names (or 100,000 shard names) make the writer's manifest larger
    than the 256 KB cap of the run-record files: it was refused as if damaged."""
    root = make_set(tmp_path / "set", 4, classes=21_841)
    assert (root / "manifest.json").stat().st_size > 256 * 1024
    ss = ShardSet.open(root / "train")
    assert len(ss.classes) == 21_841


def test_an_error_line_reads_one_key_not_the_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """where(i) names the member from one row of the key column (the old code loaded all keys: 38 MB
    at ImageNet scale, in every process that named a sample), on a cached descriptor: the loaders
    name every sample they read, and an open per sample is an RPC on a cluster filesystem."""
    root = make_set(tmp_path / "set", 50)
    ss = ShardSet.open(root / "train")
    counts = count_calls(monkeypatch)
    assert len({ss.where(i) for i in range(150)}) == 150
    assert counts["open"] == 1, counts
    monkeypatch.undo()
    assert ss.where(149).startswith("train-000049.tar member 00000149_n") and ss.where(149).endswith("_149.jpg")
    assert ss.key(149).startswith("00000149_n") and not hasattr(ss, "_keys")
    named = [ss.where(i) for i in (0, 2, 3, 149)]
    (root / "train" / SET_INDEX).unlink()  # the per-shard indexes: the same names
    per_shard = ShardSet.open(root / "train")
    assert [per_shard.where(i) for i in (0, 2, 3, 149)] == named
    assert (root / "train" / ("train-000049.tar" + INDEX_SUFFIX)).is_file()


def test_a_split_without_its_set_index_reads_one_index_per_shard_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every open of a split without shards.idx read all per-shard indexes (~100 s at 100,000
    shards, every rank, every requeue). The launcher's pre-check and the ranks open with remember=True:
    the first open writes the set index, the next opens read one file, as with the writer's set."""
    root = make_set(tmp_path / "set", 60)
    for split in ("train", "val"):
        (root / split / SET_INDEX).unlink()
    first = ShardSet.open(root / "train", remember=True)
    assert (root / "train" / SET_INDEX).is_file()
    counts = count_calls(monkeypatch)
    again = ShardSet.open(root / "train")
    monkeypatch.undo()
    assert counts["open"] <= 3, counts  # the set index (and the manifest), not 60 per-shard indexes
    assert again.fingerprint == first.fingerprint and np.array_equal(again.labels, first.labels)
    assert [again.key(i) for i in (0, 100, 179)] == [first.key(i) for i in (0, 100, 179)]
    check_data(DataConfig(name="shards", root=str(root)), local=True)  # the pre-check remembers val/ too
    assert (root / "val" / SET_INDEX).is_file()


def test_remembering_a_set_index_writes_nothing_where_it_must_not(tmp_path: Path) -> None:
    """A plain open (verify's) writes nothing; nor does one through a linked split folder (no write
    follows a link) or one whose folder cannot be written: the open itself still succeeds."""
    root = make_set(tmp_path / "set", 5)
    (root / "train" / SET_INDEX).unlink()
    ShardSet.open(root / "train")
    assert not (root / "train" / SET_INDEX).exists()
    (tmp_path / "linked").symlink_to(root / "train")
    assert len(ShardSet.open(tmp_path / "linked", remember=True)) == 15
    assert not (root / "train" / SET_INDEX).exists()
    if os.geteuid() != 0:  # root writes anywhere
        (root / "train").chmod(0o555)
        try:
            assert len(ShardSet.open(root / "train", remember=True)) == 15
        finally:
            (root / "train").chmod(0o755)
        assert not (root / "train" / SET_INDEX).exists()
