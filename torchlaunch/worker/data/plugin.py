"""The plug-in reader: a `data.name=pkg.module:factory` dataset, decoded into memory or read per sample."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from torchlaunch.config import ConfigError, DataConfig
from torchlaunch.worker.data.base import DataBundle, ImageSet, SampleReader, channel_stats
from torchlaunch.worker.data.shards import probe_stats, shard_split


class PluginSamples(SampleReader):
    """A plug-in split read sample by sample (the per-sample loader's path for a plug-in dataset too
    large to decode into memory): position i is dataset[index[i]], converted to uint8 (3, S, S)."""

    def __init__(self, path: str, split: str, dataset: Any, index: list[int]) -> None:
        self.path, self.split, self.dataset, self.index = path, split, dataset, index

    def __len__(self) -> int:
        return len(self.index)

    def subset(self, positions: list[int]) -> PluginSamples:
        return PluginSamples(self.path, self.split, self.dataset, [self.index[p] for p in positions])

    def image(self, i: int, size: int) -> torch.Tensor:
        from torchlaunch.worker import plugins

        j = self.index[i]
        return plugins.to_uint8(self.path, self.split, j, self.dataset[j][0], size)

    def open(self, i: int, draft_to: tuple[int, int] | None = None) -> Image.Image:
        """The sample at its own size (for RandomResizedCrop and the evaluation resize): a PIL image as
        returned, a tensor through uint8 of its own size."""
        from torchlaunch.worker import plugins

        j = self.index[i]
        image = self.dataset[j][0]
        if isinstance(image, Image.Image):
            return image.convert("RGB")
        size = tuple(image.shape[1:]) if isinstance(image, torch.Tensor) and image.dim() == 3 else (0, 0)
        x = plugins.to_uint8(self.path, self.split, j, image, size[0]) if size[0] == size[1] else None
        if x is None:  # a non-square tensor: to_uint8 squashes, so convert it here
            x = image.detach().cpu()
            x = ((x.float() * 255.0).round().clamp(0, 255) if x.is_floating_point() else x).to(torch.uint8)
        return Image.fromarray(x.permute(1, 2, 0).contiguous().numpy())

    def where(self, i: int) -> str:
        return f"{self.path!r} {self.split} sample {self.index[i]}"


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), else physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plugin_labels(path: str, split: str, ds: Any, n: int, num_classes: int) -> torch.Tensor:
    """The first n labels: from `ds.targets` when the dataset has them (no sample is read), else by
    reading every sample once."""
    from torchlaunch.worker import plugins

    targets = getattr(ds, "targets", None)
    if targets is not None and len(targets) == len(ds):
        labels = [plugins.to_label(path, split, i, targets[i], num_classes) for i in range(n)]
        if labels and labels[0] != plugins.to_label(path, split, 0, ds[0][1], num_classes):
            raise ConfigError(
                "data.name",
                f"{path!r}: the {split} split's targets[0] differs from the label of sample 0",
                "make `targets` list the samples' labels, or remove it",
            )
    else:
        labels = [plugins.to_label(path, split, i, ds[i][1], num_classes) for i in range(n)]
    return torch.tensor(labels, dtype=torch.int64)


def plugin_split(path: str, split: str, ds: Any, n: int, size: int, num_classes: int, in_memory: bool) -> ImageSet:
    """The first n samples of a plug-in split as the project's ImageSet: decoded once into one uint8
    tensor (the fast in-memory loader), or a PluginSamples for the per-sample loader."""
    from torchlaunch.worker import plugins

    if not in_memory:
        return ImageSet(
            labels=plugin_labels(path, split, ds, n, num_classes), files=PluginSamples(path, split, ds, list(range(n)))
        )
    images = torch.empty(n, 3, size, size, dtype=torch.uint8)
    labels = torch.empty(n, dtype=torch.int64)
    for i in range(n):
        image, label = ds[i]
        images[i] = plugins.to_uint8(path, split, i, image, size)
        labels[i] = plugins.to_label(path, split, i, label, num_classes)
    return ImageSet(labels=labels, images=images)


def load_plugin(cfg: DataConfig) -> DataBundle:
    """A `data.name=pkg.module:factory` dataset. data.loader=tensor decodes it into memory, pil reads it
    per sample through a DataLoader, auto decodes it into memory when the uint8 images take at most a
    quarter of the available memory. Both paths batch by the global-step plan and augment the batch
    the same way, so exact resume holds on either."""
    from torchlaunch.data.shards.reader import is_shard_set  # the shard reader: not at a worker's start
    from torchlaunch.worker import plugins

    found = plugins.load_data(cfg.name, cfg.root, cfg.image_size)
    size, k = cfg.image_size, len(found.classes)
    if is_shard_set(found.train) or is_shard_set(found.val):  # shard storage: read per sample, never in memory
        train = shard_split(found.train, cfg.max_train_samples) if is_shard_set(found.train) else None
        val = shard_split(found.val, cfg.max_val_samples) if is_shard_set(found.val) else None
        if train is None or val is None:
            raise ConfigError(
                "data.name", f"{cfg.name!r}: one split is a shard set and the other is not", "return both as ShardSets"
            )
        mean, std = probe_stats(train, size)
        return DataBundle(train, val, list(found.classes), mean, std, size)
    n_train = min(len(found.train), cfg.max_train_samples or len(found.train))
    n_val = min(len(found.val), cfg.max_val_samples or len(found.val))
    in_memory = cfg.loader == "tensor" or (
        cfg.loader == "auto"
        and cfg.train_crop != "resized"  # the resized crop needs each image at its own size
        and (n_train + n_val) * 3 * size * size <= available_memory() // 4
    )
    train = plugin_split(cfg.name, "train", found.train, n_train, size, k, in_memory)
    val = plugin_split(cfg.name, "val", found.val, n_val, size, k, in_memory)
    if train.images is not None:
        mean, std = channel_stats(train.images)
    else:  # estimate from an evenly spaced sample of at most ~512 images
        probe = torch.stack([train.decode(i, size) for i in range(0, len(train), max(1, len(train) // 512))])
        mean, std = channel_stats(probe)
    return DataBundle(train, val, list(found.classes), mean, std, size)
