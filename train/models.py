"""Model registry: the seeds' simple CNN, a CIFAR-stem ResNet-18, and a fast airbench-style net."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from train.exit_codes import BadInput


def simple_cnn(num_classes: int, width: int = 0) -> nn.Module:
    """The classic first CNN: three conv blocks, then a linear classifier (32x32 inputs)."""
    w = width or 32
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.BatchNorm2d(4 * w), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * w * 4 * 4, num_classes),
    )


def resnet18(num_classes: int, width: int = 0) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem: 3x3 stride-1 first conv and no max-pool."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    if width:
        raise BadInput("config error: model.width: resnet18 has a fixed width (use model.width=0)")
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class _ConvGroup(nn.Module):
    """conv -> pool -> BN -> GELU -> conv -> BN -> GELU: the airbench block shape."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = nn.BatchNorm2d(cout, momentum=0.4)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(cout, momentum=0.4)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        return self.act(self.norm2(self.conv2(x)))


class FastNet(nn.Module):
    """A small, wide-early CIFAR net in the spirit of the airbench family: a 2x2 stem, three
    conv groups that halve the resolution, global max-pool and a scaled linear head. Few layers
    and large early strides keep it cheap per image while reaching >90% on CIFAR-10 in few epochs."""

    def __init__(self, num_classes: int, width: int = 0) -> None:
        super().__init__()
        w = width or 64
        widths = (w, 4 * w, 4 * w)
        self.stem = nn.Sequential(nn.Conv2d(3, 24, 2, padding=0, bias=True), nn.GELU())
        self.groups = nn.Sequential(_ConvGroup(24, widths[0]), _ConvGroup(widths[0], widths[1]),
                                    _ConvGroup(widths[1], widths[2]))
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.scale = 1 / 9

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1)) * self.scale


REGISTRY: dict[str, Callable[[int, int], nn.Module]] = {
    "simple_cnn": simple_cnn,
    "resnet18": resnet18,
    "fastnet": FastNet,
}


def build_model(name: str, num_classes: int, width: int = 0) -> nn.Module:
    if name not in REGISTRY:
        raise BadInput(f"config error: model.name: unknown model {name!r} (choose one of: {', '.join(REGISTRY)})")
    return REGISTRY[name](num_classes, width)
