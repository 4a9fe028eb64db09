"""A dataset plug-in: `data.name=examples.my_data:color_blobs` (run from the repository root, or put the
folder holding `examples/` on PYTHONPATH).

Contract (train/plugins.py has the full text): the factory is called with the keywords it accepts
among `root` (= data.root) and `image_size` (= data.image_size) and returns `(train, val, classes)`:
- `train`, `val`: map-style datasets (`__len__`, `__getitem__`); item i is `(image, label)` where image
  is a PIL image or a 3xHxW tensor (uint8 0-255, or float 0-1) and label an int in [0, len(classes));
- `classes`: the class names.
Both image kinds are accepted; this example returns PIL images for training and float tensors for
validation to show it. Items must be deterministic: the trainer draws crops and flips itself, per
global step, which is what keeps an interrupted run's resume bit-exact. A `targets` list (as on
torchvision datasets) lets the per-sample loader skip reading every sample once for its labels.
The worker decodes a dataset into memory when it fits (a quarter of the free memory), else reads it
sample by sample through a DataLoader (`data.loader=pil` forces that)."""

from __future__ import annotations

import torch
from PIL import Image
from torch.utils.data import Dataset

CLASSES = ["red", "green", "blue", "yellow"]


class ColorBlobs(Dataset):
    """Noisy images whose class is the colour of a soft blob; deterministic from (seed, index)."""

    def __init__(self, size: int, image_size: int, seed: int, as_pil: bool) -> None:
        self.size, self.image_size, self.seed, self.as_pil = size, image_size, seed, as_pil
        g = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, len(CLASSES), (size,), generator=g).tolist()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[Image.Image | torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = self.targets[i]
        colour = torch.tensor([[1.0, 0.1, 0.1], [0.1, 1.0, 0.1], [0.1, 0.1, 1.0], [1.0, 1.0, 0.1]])[label]
        s = self.image_size
        yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
        cy, cx = torch.randint(s // 4, 3 * s // 4, (2,), generator=g)
        blob = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2).float() / (2 * (s / 5) ** 2))
        image = 0.3 + 0.35 * blob[None] * colour[:, None, None] + 0.35 * torch.randn(3, s, s, generator=g)
        image = image.clamp(0, 1)
        if self.as_pil:
            return Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy()), label
        return image, label


def color_blobs(
    image_size: int = 32, train_size: int = 1024, val_size: int = 256
) -> tuple[Dataset, Dataset, list[str]]:
    """PIL images for training, float tensors for validation; 4 classes."""
    return (
        ColorBlobs(train_size, image_size, seed=1, as_pil=True),
        ColorBlobs(val_size, image_size, seed=2, as_pil=False),
        list(CLASSES),
    )
