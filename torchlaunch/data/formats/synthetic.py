"""The synthetic data format: generated images, in memory (no data.root). One module: its config
section, the bound of its size and its registry entry."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchlaunch.base.rules import at_least
from torchlaunch.data.registry import DataConfig, DataFormat, lazy, register
from torchlaunch.exit_codes import ConfigError

MAX_SYNTHETIC = 10**7
"""Synthetic images per split: they are generated into memory."""
MAX_SYNTHETIC_BYTES = 32 * 2**30
"""Synthetic images (train + validation) held in memory at once, in bytes."""
MAX_CLASSES = 10**6


def check_synthetic(cfg: DataConfig) -> None:
    """Generated images live in memory: refuse a size that could not fit before any rank allocates it."""
    synthetic_bytes = (cfg.synthetic_train_size + cfg.synthetic_val_size) * 3 * cfg.image_size**2
    if synthetic_bytes > MAX_SYNTHETIC_BYTES:
        raise ConfigError(
            "data.synthetic_train_size",
            f"{cfg.synthetic_train_size} + {cfg.synthetic_val_size} images of "
            f"{cfg.image_size}x{cfg.image_size} need {synthetic_bytes / 2**30:.0f} GiB of memory, "
            f"above {MAX_SYNTHETIC_BYTES // 2**30} GiB",
            "use fewer or smaller synthetic images, e.g. data.synthetic_train_size=2048",
        )


@dataclass
class SyntheticOptions:
    """synthetic's own keys."""

    synthetic_train_size: int = field(default=2048, metadata=at_least(1, MAX_SYNTHETIC, "e.g. 2048"))
    """synthetic only: number of training images."""
    synthetic_val_size: int = field(default=512, metadata=at_least(1, MAX_SYNTHETIC, "e.g. 512"))
    """synthetic only: number of validation images."""
    synthetic_classes: int = field(default=10, metadata=at_least(2, MAX_CLASSES, "e.g. 10"))
    """synthetic only: number of classes."""


register(
    DataFormat(
        name="synthetic",
        summary="generated images",
        load=lazy("torchlaunch.worker.data.synthetic:make_synthetic"),
        root="unused",
        validate=check_synthetic,
        options=SyntheticOptions,
    )
)
