"""The worker's data path: readers (one module per format, behind the reader interface of
`base`), augmentation, loaders; the batch plan they follow is torchlaunch.core.sampler.

    synthetic, cifar10, imagefolder, plugin, shards   readers: a DataConfig -> DataBundle
    base        ImageSet / DataBundle / SampleReader (the reader interface)
    augment     batched crop + flip + cutout + normalisation; RandomResizedCrop and evaluation boxes
    loaders     TrainLoader (the plan's micro-batches) and eval_batches

Every name the package exported as one module is still importable from here.
"""

from __future__ import annotations

from torchlaunch.config import DataConfig
from torchlaunch.core.sampler import CROP_PADDING, BatchPlan, mix_seed
from torchlaunch.data.folders import DECODE_ERRORS, IMAGE_EXTENSIONS, decode_error, scan_imagefolder
from torchlaunch.data.formats.cifar10 import cifar10_missing_message
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data.augment import Normalizer, augment, cutout
from torchlaunch.worker.data.base import (
    DataBundle,
    ImageSet,
    SampleReader,
    channel_stats,
    decode_image,
    file_size,
    open_file,
)
from torchlaunch.worker.data.cifar10 import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10_TRAIN_BATCHES,
    load_cifar10,
    read_cifar_batches,
)
from torchlaunch.worker.data.imagefolder import (
    cached_images,
    common_size,
    folder_images,
    load_imagefolder,
    split_indices,
)
from torchlaunch.worker.data.loaders import TrainLoader, eval_batches, eval_shard
from torchlaunch.worker.data.plugin import PluginSamples, available_memory, load_plugin, plugin_labels, plugin_split
from torchlaunch.worker.data.shards import ShardSamples, load_shards
from torchlaunch.worker.data.synthetic import make_synthetic
from torchlaunch.worker.folder_cache import (
    cache_images_file,
    decode_all,
    folder_fingerprint,
    images_checksum,
    publish,
    take_prefetched,
)

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR10_TRAIN_BATCHES",
    "CROP_PADDING",
    "DECODE_ERRORS",
    "IMAGE_EXTENSIONS",
    "BatchPlan",
    "DataBundle",
    "ImageSet",
    "Normalizer",
    "PluginSamples",
    "SampleReader",
    "ShardSamples",
    "TrainLoader",
    "augment",
    "available_memory",
    "cache_images_file",
    "cached_images",
    "channel_stats",
    "cifar10_missing_message",
    "common_size",
    "cutout",
    "decode_all",
    "decode_error",
    "decode_image",
    "eval_batches",
    "eval_shard",
    "file_size",
    "folder_fingerprint",
    "folder_images",
    "images_checksum",
    "load_bundle",
    "load_cifar10",
    "load_imagefolder",
    "load_plugin",
    "load_shards",
    "make_synthetic",
    "mix_seed",
    "open_file",
    "plugin_labels",
    "plugin_split",
    "publish",
    "read_cifar_batches",
    "scan_imagefolder",
    "split_indices",
    "take_prefetched",
]


def load_bundle(cfg: DataConfig) -> DataBundle:
    """The configured dataset (its format's reader, from torchlaunch.data.registry), truncated by
    max_train_samples / max_val_samples."""
    from torchlaunch.data import registry

    bundle = registry.get(cfg.name).load(cfg)
    bundle.train = bundle.train.head(cfg.max_train_samples)
    bundle.val = bundle.val.head(cfg.max_val_samples)
    if len(bundle.train) == 0 or len(bundle.val) == 0:
        raise BadInput(
            "data error: empty training or validation split (add data or raise "
            "data.max_train_samples / data.max_val_samples)"
        )
    return bundle
