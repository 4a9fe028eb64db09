"""The `imagefolder` reader: class folders of image files, either decoded once into the uint8 cache
(same-size images: the in-memory path) or read per file in DataLoader workers (any size)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from torchlaunch.config import ConfigError, DataConfig
from torchlaunch.core.sampler import mix_seed
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data.base import DataBundle, ImageSet, channel_stats, decode_image
from torchlaunch.worker.folder_cache import (
    DECODE_ERRORS,
    cache_images_file,
    decode_all,
    decode_error,
    folder_fingerprint,
    images_checksum,
    publish,
    scan_imagefolder,
    take_prefetched,
)


def common_size(files: list[str]) -> tuple[int, int] | None:
    """(w, h) when every image has the same size (header reads only), else None."""
    first: tuple[int, int] | None = None
    for f in files:
        try:
            with Image.open(f) as im:
                size = im.size
        except DECODE_ERRORS as e:
            raise decode_error(f, e) from None
        if first is None:
            first = size
        elif size != first:
            return None
    return first


def cached_images(cache_dir: Path, key: str, count: int) -> torch.Tensor | None:
    """The decoded uint8 (count, 3, H, W) array for a folder fingerprint, if an earlier run (or rank, or the
    start-up prefetch in train/folder_cache.py) built it. A cache that does not read back as such (truncated,
    overwritten) is removed and reported missing, so the caller decodes and publishes it anew."""
    images_file = cache_images_file(cache_dir, key)
    if not images_file.is_file():
        return None
    try:
        images = np.load(images_file, allow_pickle=False)
    except (ValueError, OSError, EOFError):
        images = None
    if images is None or images.dtype != np.uint8 or images.ndim != 4 or images.shape[:2] != (count, 3):
        shutil.rmtree(images_file.parent, ignore_errors=True)
        return None
    try:
        recorded = json.loads((images_file.parent / "meta.json").read_text()).get("checksum")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded != images_checksum(images):  # overwritten, damaged, or from before the checksum: rebuild
        shutil.rmtree(images_file.parent, ignore_errors=True)
        return None
    return torch.from_numpy(images)


def split_indices(n: int, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, seeded train/validation split of n samples, each in the seeded shuffled order (not sorted:
    folders are scanned class by class, so the first N of a sorted split would hold a single class)."""
    g = torch.Generator().manual_seed(mix_seed(split_seed, 104729))
    perm = torch.randperm(n, generator=g)
    n_val = max(1, round(n * val_fraction))
    return perm[n_val:], perm[:n_val]


def folder_images(cfg: DataConfig) -> tuple[ImageSet, list[str]]:
    """Every image under cfg.root with its class names: decoded uint8 (tensor loader, from the cache)
    or file paths (pil loader, for images of any size). Training and evaluation share this."""
    root = Path(cfg.root).expanduser()
    loader = cfg.loader
    if loader == "auto" and cfg.train_crop == "resized":  # original-aspect files, never the square cache
        loader = "pil"
    cache_dir = Path(cfg.cache_dir).expanduser()
    index = take_prefetched(root, cache_dir) if loader in ("auto", "tensor") else None
    if index is not None:  # the start-up prefetch scanned the folder while torch was imported
        cached = cached_images(cache_dir, index.key, sum(index.counts))
        if cached is not None and tuple(cached.shape[2:]) == (cfg.image_size, cfg.image_size):
            labels = torch.repeat_interleave(torch.arange(len(index.classes)), torch.tensor(index.counts))
            return ImageSet(labels=labels, images=cached), index.classes
    classes, files, label_list = scan_imagefolder(root)
    labels = torch.tensor(label_list, dtype=torch.int64)
    cached, decoded, key, size = None, None, "", None
    if loader in ("auto", "tensor"):
        key = folder_fingerprint(root, files)
        cached = cached_images(cache_dir, key, len(files))  # a cache exists only for same-size images
        if cached is not None:
            size = (int(cached.shape[3]), int(cached.shape[2]))
        else:
            decoded = decode_all(files, cfg.image_size)
            size = (cfg.image_size, cfg.image_size) if decoded is not None else common_size(files)
    if loader == "tensor" and size != (cfg.image_size, cfg.image_size):
        found = "differ in size" if size is None else f"are {size[0]}x{size[1]}"
        raise ConfigError(
            "data.loader",
            f"images under {root} {found}, not {cfg.image_size}x{cfg.image_size}",
            "use data.loader=pil, which resizes to data.image_size",
        )
    if loader == "tensor" or (loader == "auto" and size == (cfg.image_size, cfg.image_size)):
        images = cached if cached is not None else torch.from_numpy(publish(decoded, root, cache_dir, key))
        return ImageSet(labels=labels, images=images), classes
    return ImageSet(labels=labels, files=files), classes


def load_imagefolder(cfg: DataConfig) -> DataBundle:
    everything, classes = folder_images(cfg)
    if len(everything) < 2:
        raise BadInput(
            f"data error: {cfg.root} has only {len(everything)} image(s); need at least 2 to hold "
            f"out a validation split (add images)"
        )
    train_idx, val_idx = split_indices(len(everything), cfg.val_fraction, cfg.split_seed)
    train = everything.subset(train_idx)
    if train.images is not None:
        mean, std = channel_stats(train.images)
    else:  # estimate from an evenly spaced sample of at most ~512 decoded images
        probe = torch.stack([decode_image(f, cfg.image_size) for f in train.files[:: max(1, len(train) // 512)]])
        mean, std = channel_stats(probe)
    return DataBundle(train, everything.subset(val_idx), classes, mean, std, cfg.image_size)


def imagefolder_eval_set(cfg: DataConfig, split: str) -> tuple[ImageSet, list[str]]:
    """Evaluation on class folders: every image (split "all"), or the run's seeded validation split
    ("val"), decoded the way training decodes (same cache, same loader choice)."""
    if split == "val":
        bundle = load_imagefolder(cfg)
        return bundle.val, bundle.classes
    return folder_images(cfg)
