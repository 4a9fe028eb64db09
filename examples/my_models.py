"""A model plug-in: `model.name=examples.my_models:tiny_cnn` (run from the repository root, or put the
folder holding `examples/` on PYTHONPATH).

The worker calls the factory as `tiny_cnn(num_classes=N)`, adding `width=W` only when `model.width`
is set, and expects a torch.nn.Module mapping (B, 3, S, S) float images to (B, N) logits. Nothing else
is required: no registration, no base class. The import path is stored in every checkpoint, so
`python -m train.evaluate --run-dir RUN_DIR` rebuilds this model."""

from __future__ import annotations

from torch import nn


def tiny_cnn(num_classes: int, width: int = 16) -> nn.Module:
    """Two conv blocks and a linear head; any input size (global average pooling)."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


def tiny_gn_cnn(num_classes: int, width: int = 16) -> nn.Module:
    """tiny_cnn with GroupNorm instead of BatchNorm. BatchNorm normalises over each rank's own
    micro-batch, so its step depends on how the global batch is split; GroupNorm normalises each sample
    alone, so this model takes the same step on any world size (up to float summation order), which
    is what a run that loses or regains a node wants."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.GroupNorm(4, width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.GroupNorm(4, 2 * width),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )
