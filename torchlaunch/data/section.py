"""The data section of the run's config: the keys every data format shares, and the one type that
joins them with each registered format's own section.

Why here, below the config: a data format registers its own config section with its reader and
pre-check (torchlaunch.data.registry, DataFormat.options), so the data section's type is known only
to the data floor; torchlaunch.config asks `data_config()` for it and knows no format by name. The keys stay flat under `data.` (data.download, data.shard_label, data.synthetic_train_size
...), as users have always written them, and a format's key is refused when another format or the
shared section already has it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from torchlaunch.base.rules import at_least, choice, seed_bound
from torchlaunch.base.untrusted import quote
from torchlaunch.data import registry
from torchlaunch.exit_codes import ConfigError

MAX_WORKERS = 64
"""DataLoader processes per rank: more is a process bomb, not a faster loader."""
MAX_IMAGE_SIZE = 4096
"""Side of an image the model sees (a 4096^2 RGB batch of 256 is already 12 GiB)."""
MAX_SAMPLES = 10**12
SECTIONS = "__sections__"
"""The attribute of a composed data section naming the classes its fields come from, in order (the
config reads each field's docstring from its own class: `python -m train --help-config`)."""


@dataclass
class SharedData:
    """The keys of the data section that every format reads (the reader, the loaders, augmentation)."""

    name: str = field(default="synthetic", metadata=choice((), plugin=True, source=registry.names))
    """Dataset: `cifar10` (torchvision's python batches), `imagefolder` (class folders), `shards` (a tar
    shard set written by `python -m train.shards write`: root holds manifest.json, train/, val/), `synthetic`, or
    your own as an import path `pkg.module:factory` (imported from the run's working directory or
    PYTHONPATH; the factory returns (train, val, classes), contract in torchlaunch/worker/plugins.py and
    examples/my_data.py)."""
    root: str = "data"
    """cifar10: folder holding cifar-10-batches-py; imagefolder: folder of class folders; shards: the
    shard set's folder."""
    split_seed: int = field(default=0, metadata=seed_bound())
    """Seed of the train/validation split; independent of `seed` so runs share one split."""
    loader: str = field(default="auto", metadata=choice(("auto", "tensor", "pil")))
    """`tensor` (decoded uint8 cache + batched augmentation), `pil` (per-sample), `auto` (tensor when
    every image has the same size; a plug-in dataset: when its uint8 images fit in a quarter of the
    free memory)."""
    num_workers: int = field(default=2, metadata=at_least(0, MAX_WORKERS, "use 0 to load in the training process"))
    """DataLoader worker processes per rank for the `pil` loader."""
    cache_dir: str = "~/.cache/torchlaunch"
    """Where decoded uint8 datasets are cached, keyed by the source's fingerprint."""
    image_size: int = field(default=32, metadata=at_least(8, MAX_IMAGE_SIZE, "e.g. data.image_size=32"))
    """Side length the model sees; the pil loader resizes other sizes to it."""
    augment: bool = True
    """Train-time random crop (random translation) + horizontal flip."""
    crop_padding: int = field(default=4, metadata=at_least(0, MAX_IMAGE_SIZE, "e.g. data.crop_padding=4"))
    """Random crop: pad each side by this many pixels, then crop back (translations of up to +-N)."""
    pad_mode: str = field(default="zeros", metadata=choice(("zeros", "reflect")))
    """Padding of the random crop: `zeros` (torchvision's RandomCrop) or `reflect` (mirror the border)."""
    flip: str = field(default="random", metadata=choice(("random", "alternate", "none")))
    """`random` (each image flipped with p=0.5 each epoch), `alternate` (a random half in the first
    epoch, then every image flips each epoch: each image is seen both ways every two epochs), `none`."""
    cutout: int = field(default=0, metadata=at_least(0, MAX_IMAGE_SIZE, "use 0 for off, e.g. data.cutout=12"))
    """Cutout: blank one random N x N square of every training image (after crop and flip) to the
    channel mean; drawn per global step like the crops (0 = off; airbench96 uses 12 on 32x32 images)."""
    # -- ImageNet-style crops (issue 27) --
    train_crop: str = field(default="pad", metadata=choice(("pad", "resized")))
    """Training crop: `pad` (pad by crop_padding, crop back to the image: CIFAR's translation crop) or
    `resized` (torchvision's RandomResizedCrop, scale 0.08-1 and ratio 3/4-4/3, on the original-aspect
    image, resized to image_size; needs a per-sample path: imagefolder with the pil loader, shards, or a
    plug-in read per sample). Its variates are drawn per global step, so any world size sees the same boxes."""
    val_resize: int = field(
        default=0,
        metadata=at_least(0, MAX_IMAGE_SIZE, "use 0 for the default, e.g. data.val_resize=256 for image_size 224"),
    )
    """Evaluation on the per-sample path: resize the shorter side to this, then centre-crop image_size.
    0 = round(image_size / 0.875) (256 for 224) when train_crop=resized, else squash to image_size."""
    decode: str = field(default="cpu", metadata=choice(("cpu", "gpu")))
    """Training JPEG decode with train_crop=resized: `cpu` (PIL in DataLoader workers) or `gpu` (workers
    read the encoded bytes and the step's boxes and flips; the rank decodes the batch with
    torchvision.io.decode_jpeg on its CUDA device and crops, resizes and flips there; shards and
    imagefolder only; other formats and modes of a sample decode on the CPU). Evaluation stays on the CPU."""
    # -- end of the ImageNet-style crops --
    max_train_samples: int = field(default=0, metadata=at_least(0, MAX_SAMPLES, "use 0 for all samples"))
    """Use only the first N training samples (0 = all): quick experiments and benchmarks."""
    max_val_samples: int = field(default=0, metadata=at_least(0, MAX_SAMPLES, "use 0 for all samples"))
    """Use only the first N validation samples (0 = all)."""


def compose(options: Sequence[type]) -> type:
    """The data section type: SharedData's fields, then each format section's, in registration order.
    ValueError when a key is defined twice (two formats, or a format and the shared keys)."""
    owners: dict[str, str] = {}
    fields: list[tuple[str, typing.Any, typing.Any]] = []
    for section in (SharedData, *options):
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if f.name in owners:
                raise ValueError(f"data.{f.name} of {section.__name__} is already a key of {owners[f.name]}")
            owners[f.name] = section.__name__
            fresh = field(default=f.default, default_factory=f.default_factory, metadata=f.metadata)
            fields.append((f.name, hints[f.name], fresh))
    composed = dataclasses.make_dataclass("DataConfig", fields)
    composed.__module__ = __name__
    composed.__doc__ = "The data section: " + ", ".join(s.__name__ for s in (SharedData, *options)) + "."
    setattr(composed, SECTIONS, (SharedData, *options))
    return composed


_COMPOSED: dict[tuple[type, ...], type] = {}


def data_config() -> type:
    """The data section type of the formats registered now (one type per set of sections, so a run
    that registers nothing late sees one DataConfig throughout). The built-ins compose when
    torchlaunch.data is imported; a format registered later (a third-party package) joins at the next
    config load."""
    options = registry.options()
    if options not in _COMPOSED:
        _COMPOSED[options] = compose(options)
    return _COMPOSED[options]


DataConfig = typing.Any
"""A composed data section (data_config()), as the checks below read it."""


def is_data_section(tp: object) -> bool:
    """Whether a type is a composed data section (the config substitutes the current one for it)."""
    return isinstance(tp, type) and hasattr(tp, SECTIONS)


def check(data: DataConfig) -> None:
    """The data section's rules that tie two keys together or ask the format (each key's own bound is
    in its field's metadata, checked by torchlaunch.config.validate first); ConfigError on the first."""
    if data.crop_padding > data.image_size:
        raise ConfigError(
            "data.crop_padding",
            f"{data.crop_padding} is larger than data.image_size={data.image_size}",
            "pad by a few pixels, e.g. data.crop_padding=4",
        )
    data_format = registry.get(data.name)
    if data_format.validate is not None:
        data_format.validate(data)
    if data.cutout > data.image_size:
        raise ConfigError(
            "data.cutout",
            f"{data.cutout} is larger than data.image_size={data.image_size}",
            f"use a square of at most {data.image_size}, e.g. data.cutout=12, or 0 for off",
        )
    if data.decode == "gpu" and (not data_format.gpu_decode or data.train_crop != "resized"):
        readers = " or ".join(registry.names(gpu_decode=True))
        raise ConfigError(
            "data.decode",
            f"gpu decodes the JPEGs of data.name={readers} with "
            f"data.train_crop=resized, got data.name={quote(data.name)} data.train_crop={quote(data.train_crop)}",
            f"use data.decode=cpu, or data.train_crop=resized with data.name={readers}",
        )


def check_root(data: DataConfig) -> None:
    """A format that reads data.root needs one."""
    if not str(data.root).strip() and registry.get(data.name).root == "required":
        raise ConfigError("data.root", "must not be empty", "point it at your dataset folder")


def refuse_unread(data: DataConfig, given: Collection[str]) -> None:
    """A typed `data.root=DIR` on a recipe whose format reads no root (synthetic) would train on
    generated images and say nothing: refused, naming the formats that read a folder."""
    data_format = registry.get(data.name)
    if "data.root" in given and data_format.root == "unused":
        readers = [
            f"data.name={n} for {registry.get(n).summary}"
            for n in registry.names()
            if registry.get(n).root == "required"
        ]
        raise ConfigError(
            "data.root",
            f"{quote(data.root)} is not read: the recipe's data.name is {data.name} ({data_format.summary})",
            f"add {', '.join(readers[:-1])}, or {readers[-1]}" if len(readers) > 1 else f"add {''.join(readers)}",
        )
