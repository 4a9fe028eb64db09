"""The `cifar10` reader: CIFAR-10's python batches, read natively into memory."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchlaunch.config import DataConfig
from torchlaunch.data.formats.cifar10 import cifar10_missing_message  # shared with the launchers' pre-spawn check
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data.base import DataBundle, ImageSet

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what the CIFAR-10 python batches hold (dicts, lists, strings and numpy arrays; bytes
    as `_codecs.encode` when written by Python 3): the files are read without torchvision's md5 pass, so a
    foreign pickle must not run code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR-10 batch")
        return super().find_class(module, name)


def read_cifar_batches(folder: Path, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 3, 32, 32) and int64 labels of CIFAR-10 python batches, byte for byte what
    torchvision.datasets.CIFAR10 reads, without importing torchvision (and torch._dynamo with it)."""
    data, labels = [], []
    for name in names:
        with open(folder / name, "rb") as fh:
            entry = _CifarUnpickler(fh, encoding="latin1").load()
        batch = np.asarray(entry["data"], dtype=np.uint8)
        batch_labels = entry["labels"] if "labels" in entry else entry["fine_labels"]
        if batch.ndim != 2 or batch.shape[1] != 3 * 32 * 32 or len(batch_labels) != batch.shape[0]:
            raise ValueError(f"{name} is not a CIFAR-10 batch (data {batch.shape}, {len(batch_labels)} labels)")
        data.append(batch)
        labels.extend(batch_labels)
    images = torch.from_numpy(np.concatenate(data).reshape(-1, 3, 32, 32))
    return images, torch.tensor(labels, dtype=torch.int64)


def load_cifar10(cfg: DataConfig) -> DataBundle:
    """CIFAR-10's python batches: the 50k train set and the 10k test set as validation. Read natively;
    torchvision is imported only to download them."""
    root = Path(cfg.root).expanduser()
    folder = root / "cifar-10-batches-py"
    present = (folder / "test_batch").is_file()
    if not present and not cfg.download:
        raise BadInput(cifar10_missing_message(root, "download is off", False))
    try:
        if not present:
            import torchvision

            torchvision.datasets.CIFAR10(str(root), train=True, download=True)
        train_images, train_labels = read_cifar_batches(folder, CIFAR10_TRAIN_BATCHES)
        val_images, val_labels = read_cifar_batches(folder, ("test_batch",))
        with open(folder / "batches.meta", "rb") as fh:
            classes = list(_CifarUnpickler(fh, encoding="latin1").load()["label_names"])
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as e:
        # URLError is an OSError; torchvision raises RuntimeError; a truncated or foreign file the rest
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadInput(
            cifar10_missing_message(root, f"download failed or files corrupt: {reason}", cfg.download and not present)
        ) from None
    return DataBundle(
        ImageSet(labels=train_labels, images=train_images),
        ImageSet(labels=val_labels, images=val_images),
        classes,
        CIFAR10_MEAN,
        CIFAR10_STD,
        32,
    )


def cifar10_eval_set(cfg: DataConfig, split: str) -> tuple[ImageSet, list[str]]:
    """Evaluation on CIFAR-10: the 10k test batch through torchvision (md5-checked before it is
    unpickled), either --split."""
    import torchvision

    root = Path(cfg.root).expanduser()
    try:
        ds = torchvision.datasets.CIFAR10(str(root), train=False, download=False)
    except (OSError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadInput(cifar10_missing_message(root, reason, tried_download=False)) from None
    images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
    return ImageSet(labels=torch.tensor(ds.targets, dtype=torch.int64), images=images), list(ds.classes)
