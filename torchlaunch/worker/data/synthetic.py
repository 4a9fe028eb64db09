"""The `synthetic` reader: deterministic random images with a learnable class signal, in memory."""

from __future__ import annotations

import torch

from torchlaunch.config import DataConfig
from torchlaunch.core.sampler import mix_seed
from torchlaunch.worker.data.base import DataBundle, ImageSet, channel_stats


def make_synthetic(cfg: DataConfig) -> DataBundle:
    """Deterministic random images with a learnable class signal: a smooth per-class colour pattern
    (4x4 upsampled, so it survives random crops and flips) plus pixel noise."""
    g = torch.Generator().manual_seed(mix_seed(cfg.split_seed, 7919))
    k, size = cfg.synthetic_classes, cfg.image_size
    coarse = torch.rand(k, 3, 4, 4, generator=g)
    templates = (
        torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False) * 96 + 80
    )

    def draw(n: int) -> ImageSet:
        labels = torch.randint(0, k, (n,), generator=g)
        noise = torch.randn(n, 3, size, size, generator=g) * 90
        images = (templates[labels] + noise).clamp(0, 255).to(torch.uint8)
        return ImageSet(labels=labels, images=images)

    train, val = draw(cfg.synthetic_train_size), draw(cfg.synthetic_val_size)
    mean, std = channel_stats(train.images)
    return DataBundle(train, val, [f"class{i}" for i in range(k)], mean, std, size)
