"""The built-in data formats, each registered once (torchlaunch.data.registry).

Readers and evaluation sets are named with `lazy`, so importing this module (the launcher does, for
its pre-check) loads neither torch nor the worker; the pre-checks are torch-free (torchlaunch.data.checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchlaunch.data.registry import PLUGIN, DataFormat, lazy, register

if TYPE_CHECKING:
    from torchlaunch.config import DataConfig

CIFAR_FOLDER = "cifar-10-batches-py"
SHARD_MANIFEST = "manifest.json"


def bundle_val(cfg: DataConfig, split: str) -> tuple[Any, list[str]]:
    """A format's own val split through its reader, as the run validated (a plug-in's evaluation set)."""
    from torchlaunch.worker.data import load_bundle

    bundle = load_bundle(cfg)
    return bundle.val, bundle.classes


def check_synthetic(cfg: DataConfig) -> None:
    """Generated images live in memory: refuse a size that could not fit before any rank allocates it."""
    from torchlaunch.config import MAX_SYNTHETIC_BYTES, ConfigError

    synthetic_bytes = (cfg.synthetic_train_size + cfg.synthetic_val_size) * 3 * cfg.image_size**2
    if synthetic_bytes > MAX_SYNTHETIC_BYTES:
        raise ConfigError(
            "data.synthetic_train_size",
            f"{cfg.synthetic_train_size} + {cfg.synthetic_val_size} images of "
            f"{cfg.image_size}x{cfg.image_size} need {synthetic_bytes / 2**30:.0f} GiB of memory, "
            f"above {MAX_SYNTHETIC_BYTES // 2**30} GiB",
            "use fewer or smaller synthetic images, e.g. data.synthetic_train_size=2048",
        )


register(
    DataFormat(
        name="cifar10",
        summary="torchvision's CIFAR-10 python batches",
        load=lazy("torchlaunch.worker.data.cifar10:load_cifar10"),
        precheck=lazy("torchlaunch.data.checks:check_cifar10_data"),
        eval_set=lazy("torchlaunch.worker.data.cifar10:cifar10_eval_set"),
        detect=lambda root: (root / CIFAR_FOLDER).is_dir(),
        held_out=("all", "val"),
    )
)
register(
    DataFormat(
        name="imagefolder",
        summary="a folder of class folders",
        load=lazy("torchlaunch.worker.data.imagefolder:load_imagefolder"),
        precheck=lazy("torchlaunch.data.checks:check_imagefolder"),
        eval_set=lazy("torchlaunch.worker.data.imagefolder:imagefolder_eval_set"),
        held_out=("val",),
        gpu_decode=True,
    )
)
register(
    DataFormat(
        name="shards",
        summary="a tar shard set",
        load=lazy("torchlaunch.worker.data.shards:load_shards"),
        precheck=lazy("torchlaunch.data.checks:check_shard_set"),
        eval_set=lazy("torchlaunch.worker.data.shards:shards_eval_set"),
        detect=lambda root: (root / SHARD_MANIFEST).is_file(),
        held_out=("all", "val"),
        gpu_decode=True,
    )
)
register(
    DataFormat(
        name="synthetic",
        summary="generated images",
        load=lazy("torchlaunch.worker.data.synthetic:make_synthetic"),
        root="unused",
        validate=check_synthetic,
    )
)
register(
    DataFormat(
        name=PLUGIN,
        summary="your own dataset factory",
        load=lazy("torchlaunch.worker.data.plugin:load_plugin"),
        eval_set=bundle_val,
        own_val=True,
        root="optional",
    )
)
