"""The `shards` reader: a tar shard set (torchlaunch.data.shards) read by random access, sample by sample,
in DataLoader workers. `data.root` holds manifest.json, train/ and val/ (python -m train.shards write).

A shard set is never decoded into memory: the point of shards is data that does not fit there. Each
sample's (width, height) comes from the index, so a RandomResizedCrop box is resolved before its
bytes are decoded and the JPEG can decode at the DCT scale the box allows."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from torchlaunch.config import DataConfig
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data.base import DataBundle, ImageSet, SampleReader, channel_stats

STATS_PROBE = 64
"""Images decoded (evenly spaced, squashed to image_size) for the normalisation's mean and std: a
few dozen give the channel means to ~1e-2, and start-up must not read thousands."""


class CleanDecodes:
    """One byte per sample of a shard set, in memory shared by this process and the DataLoader workers
    it forks (an anonymous MAP_SHARED mapping: a worker's record is seen by its siblings and by the
    workers of later epochs): 1 once the sample's bytes decoded whole without an error or a warning in
    this run (boxes.tensor_crop: the window decode read to the end marker). Later draws of the sample
    then stop decoding after their box, ~1.3x faster per decode, the same pixels.

    Why the proof is safe: a member damaged below its box decodes the box fine when the decode stops
    there, while a whole decode refuses it (exit 2); the proof is made by this run's own full decode of
    the very bytes every later read returns (ShardSet.read checks each read against the member's
    checksum in the index opened at start), so an early stop never trains on a member that the whole
    decode would refuse, and nothing on disk (a forged or stale index) can claim it. It is not kept
    across processes that do not share the mapping (a resumed run, spawned workers, another rank):
    they prove again on their first draw of each member, which costs only speed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.marks = mmap.mmap(-1, max(1, n))  # anonymous and shared on Linux/macOS; zero-filled, lazily

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return CleanDecodes, (self.n,)  # pickled (spawned workers): a fresh, unshared record

    def __contains__(self, j: int) -> bool:
        return self.marks[j] == 1

    def add(self, j: int) -> None:
        self.marks[j] = 1


class ShardSamples(SampleReader):
    """Positions of a ShardSet (the reader interface over torchlaunch.data.shards.ShardSet): position i is
    sample index[i] of the set. Pickles cheaply into DataLoader workers (the set reopens its file
    descriptors per process)."""

    def __init__(self, shards: Any, index: np.ndarray | None = None, clean: CleanDecodes | None = None) -> None:
        self.shards = shards
        self.index = np.arange(len(shards), dtype=np.int64) if index is None else index
        self.fingerprint = shards.fingerprint
        self.clean = CleanDecodes(len(shards)) if clean is None else clean

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def subset(self, positions: list[int]) -> ShardSamples:
        return ShardSamples(self.shards, self.index[np.asarray(positions, dtype=np.int64)], self.clean)

    def open(self, i: int, draft_to: tuple[int, int] | None = None) -> Image.Image:
        from torchlaunch.data.shards import decode

        j = int(self.index[i])
        return decode(self.shards.read(j), self.shards.where(j), draft_to)

    def encoded(self, i: int) -> tuple[bytes, str]:
        j = int(self.index[i])
        return self.shards.read(j), self.shards.where(j)

    def size(self, i: int) -> tuple[int, int]:
        w, h = self.shards.sizes[int(self.index[i])]
        return int(w), int(h)

    def where(self, i: int) -> str:
        return self.shards.where(int(self.index[i]))

    def decodes_clean(self, i: int) -> bool:
        return int(self.index[i]) in self.clean

    def record_clean(self, i: int) -> None:
        self.clean.add(int(self.index[i]))

    def labels(self) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.shards.labels, dtype=np.int64)[self.index])


def shard_split(shards: Any, n: int = 0) -> ImageSet:
    """The first n samples (0 = all) of a ShardSet as the per-sample ImageSet."""
    samples = ShardSamples(shards)
    if n and n < len(samples):
        samples = samples.subset(list(range(n)))
    return ImageSet(labels=samples.labels(), files=samples)


def probe_stats(train: ImageSet, size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    step = max(1, len(train) // STATS_PROBE)
    return channel_stats(torch.stack([train.decode(i, size) for i in range(0, len(train), step)][:STATS_PROBE]))


def open_splits(root: Path, label: str | None = "cls") -> tuple[Any, Any]:
    """The train and val ShardSets under root (labels from `label`, data.shard_label; None: as indexed);
    ShardError (one line, exit 2) names what is wrong."""
    from torchlaunch.data.shards import ShardSet

    train = ShardSet.open(root / "train", label=label, remember=True)
    val = ShardSet.open(root / "val", label=label, remember=True)
    if list(train.classes) != list(val.classes):
        raise BadInput(
            f"data error: {root}: train/ names {len(train.classes)} classes and val/ {len(val.classes)} "
            "(or in another order) (rewrite the set with python -m train.shards write)"
        )
    return train, val


def load_shards(cfg: DataConfig) -> DataBundle:
    root = Path(cfg.root).expanduser()
    train_set, val_set = open_splits(root, cfg.shard_label)
    train, val = shard_split(train_set), shard_split(val_set)
    mean, std = probe_stats(train, cfg.image_size)
    return DataBundle(train, val, list(train_set.classes), mean, std, cfg.image_size)


def shards_eval_set(cfg: DataConfig, split: str) -> tuple[ImageSet, list[str]]:
    """Evaluation on a shard set: its own held-out val/ split, either --split. The run's data.shard_label
    applies when the run trained on shards; otherwise the labels are read as the set was indexed."""
    _, val = open_splits(Path(cfg.root).expanduser(), cfg.shard_label if cfg.name == "shards" else None)
    return shard_split(val), list(val.classes)
