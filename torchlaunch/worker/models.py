"""Model registry: the seeds' simple CNN, a CIFAR-stem ResNet-18, a fast airbench-style net, and any
torchvision classification model by name (`torchvision.<name>`): the stock architectures as published,
so a run (or a benchmark against peers) can use exactly the model other code trains."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchlaunch import suggest
from torchlaunch.base.rules import is_plugin
from torchlaunch.config import ConfigError
from torchlaunch.trainer_sections import TORCHVISION_PREFIX


def simple_cnn(num_classes: int, width: int = 0) -> nn.Module:
    """The classic first CNN: three conv blocks, then a linear classifier (32x32 inputs)."""
    w = width or 32
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        nn.BatchNorm2d(w),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1),
        nn.BatchNorm2d(4 * w),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * w * 4 * 4, num_classes),
    )


class _BasicBlock(nn.Module):
    """ResNet's two-conv residual block, laid out as torchvision's BasicBlock (the same attribute names and
    registration order, so state_dict keys and the optimizer's parameter order match its checkpoints)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        downsample = None  # drawn before the block's convs (torchvision's order), registered after them
        if stride != 1 or cin != cout:
            downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)


class ResNet18(nn.Module):
    """ResNet-18 with the CIFAR stem (3x3 stride-1 first conv, no max-pool), without importing torchvision
    (whose import pulls in torch._dynamo: seconds of start-up). It is the model the project
    built from torchvision before: the same state_dict and, under one seed, the same initial weights
    (tests/unit/test_models.py compares every tensor), so earlier checkpoints load and resume bit for bit."""

    def __init__(self, num_classes: int, width: int = 0) -> None:
        super().__init__()
        if width:
            raise ConfigError("model.width", "resnet18 has a fixed width", "use model.width=0")
        # torchvision's ImageNet stem, replaced below: its random draws keep the stream of every later weight.
        self.conv1: nn.Module = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        # each block is created after its downsample, in torchvision's order (the draws follow it)
        self.layer1 = self._layer(64, 64, 1)
        self.layer2 = self._layer(64, 128, 2)
        self.layer3 = self._layer(128, 256, 2)
        self.layer4 = self._layer(256, 512, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)  # the CIFAR stem, in the same slot

    @staticmethod
    def _layer(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _dirac_conv(cin: int, cout: int) -> nn.Conv2d:
    """3x3 conv whose first `cin` filters start as the identity: a deep net that starts close to a
    shallow one trains fast from the first step (airbench's initialisation)."""
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[: min(cin, cout)])
    return conv


def _shift_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm that learns only a shift: the scale is fixed at 1 (the next conv can scale), which
    with a high LR on the shift is part of what makes airbench-style nets converge in few epochs."""
    norm = nn.BatchNorm2d(channels, eps=1e-12, momentum=0.4)
    norm.weight.requires_grad_(False)
    return norm


class _ConvGroup(nn.Module):
    """conv -> pool -> BN -> GELU -> conv -> BN -> GELU: the airbench block shape."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = _dirac_conv(cin, cout)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = _shift_norm(cout)
        self.conv2 = _dirac_conv(cout, cout)
        self.norm2 = _shift_norm(cout)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        return self.act(self.norm2(self.conv2(x)))


class _ResidualConvGroup(_ConvGroup):
    """_ConvGroup plus a third conv -> BN -> GELU whose output adds to the pooled activation: the block of
    airbench96. The skip keeps the deeper net as easy to optimise in a few epochs as the shallow one."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(cin, cout)
        self.conv3 = _dirac_conv(cout, cout)
        self.norm3 = _shift_norm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.act(self.norm1(self.pool(self.conv1(x))))
        x = self.act(self.norm2(self.conv2(x0)))
        return self.act(self.norm3(self.conv3(x))) + x0


def patch_matrix(images: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """Every kh x kw patch of images (N, C, H, W) as one row of a contiguous float32 (patches, C*kh*kw)
    matrix, rows in (n, y, x) order, columns in (c, i, j) order: the values and layout of
    `unfold(2, kh, 1).unfold(3, kw, 1).permute(0, 2, 3, 1, 4, 5).reshape(...)`, so the covariance
    matmul sees the same bits, but written as kh*kw shifted copies: ~2x faster than that 6-D strided
    copy (start-up of fastnet's whitening init)."""
    n, c, h, w = images.shape
    pixels = images.float().permute(0, 2, 3, 1)  # a view: (n, y, x, c)
    out = torch.empty(n, h - kh + 1, w - kw + 1, c, kh, kw, dtype=torch.float32, device=images.device)
    for i in range(kh):
        for j in range(kw):
            out[..., i, j] = pixels[:, i : i + h - kh + 1, j : j + w - kw + 1]
    return out.reshape(-1, c * kh * kw)


class FastNet(nn.Module):
    """A small, wide-early CIFAR net in the spirit of the airbench family: a fixed 2x2 patch-whitening
    stem, three conv groups that halve the resolution, global max-pool and a scaled linear head. Few
    layers and large early strides keep it cheap per image while reaching ~90% on CIFAR-10 in ten epochs.

    Call init_from_data() with normalised training images before training: the stem's filters become
    the whitening transform of the images' 2x2 patches (and their negatives), and stay frozen."""

    group: type[_ConvGroup] = _ConvGroup

    @staticmethod
    def widths(width: int) -> tuple[int, int, int]:
        """Channels of the three groups for model.width (0 = the default 64/256/256)."""
        w = width or 64
        return w, 4 * w, 4 * w

    def __init__(self, num_classes: int, width: int = 0) -> None:
        super().__init__()
        widths = self.widths(width)
        self.stem = nn.Sequential(nn.Conv2d(3, 24, 2, padding=0, bias=True), nn.GELU())
        self.stem[0].weight.requires_grad_(False)
        self.groups = nn.Sequential(
            self.group(24, widths[0]), self.group(widths[0], widths[1]), self.group(widths[1], widths[2])
        )
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.scale = 1 / 9

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Set the stem to the PCA whitening of 2x2 patches of `images` (N, 3, H, W), float.
        Deterministic for given images, so every rank computes the same filters."""
        conv = self.stem[0]
        c, kh, kw = conv.weight.shape[1:]
        patches = patch_matrix(images, kh, kw)
        cov = (patches.T @ patches).double() / patches.shape[0]
        eigenvalues, eigenvectors = torch.linalg.eigh(cov)  # ascending
        order = eigenvalues.flip(0).clamp_min(0), eigenvectors.T.flip(0)
        filters = (order[1] / torch.sqrt(order[0] + eps)[:, None]).reshape(-1, c, kh, kw)
        half = conv.weight.shape[0] // 2
        conv.weight.copy_(torch.cat([filters[:half], -filters[:half]]).to(conv.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1)) * self.scale


class FastNet93(FastNet):
    """fastnet for the 93% recipe (configs/fast93.yaml): wider (128/384/512 channels by default) and
    deeper (a third conv with a residual in every group), after airbench96 (128/512/512). The narrower
    middle group costs ~0.74x airbench96's multiply-adds per image (20 s of H200 training is the budget)."""

    group = _ResidualConvGroup

    @staticmethod
    def widths(width: int) -> tuple[int, int, int]:
        """Channels of the three groups for model.width (0 = the default 128/384/512)."""
        w = width or 128
        return w, 3 * w, 4 * w


REGISTRY: dict[str, Callable[[int, int], nn.Module]] = {
    "simple_cnn": simple_cnn,
    "resnet18": ResNet18,
    "fastnet": FastNet,
    "fastnet93": FastNet93,
}


# Models whose training-mode forward returns auxiliary outputs: the trainer expects one logits tensor.
_NO_AUX = {"googlenet", "inception_v3"}


def torchvision_model(name: str, num_classes: int, width: int = 0) -> nn.Module:
    """torchvision's stock architecture `name`, untrained (weights=None): no download, no stem changes."""
    import torchvision

    key = TORCHVISION_PREFIX + name
    if width:
        raise ConfigError("model.width", f"{key} has a fixed width, got {width}", "use model.width=0")
    valid = torchvision.models.list_models(module=torchvision.models)  # classification models only
    if name not in valid:
        near = suggest.closest(name, valid)
        hint = f"did you mean {TORCHVISION_PREFIX}{near}? " if near else ""
        raise ConfigError(
            "model.name",
            f"unknown torchvision classification model {key!r}",
            f"{hint}torchvision.models.list_models with module=torchvision.models lists valid "
            f"names; write them as {TORCHVISION_PREFIX}<name>, e.g. {TORCHVISION_PREFIX}resnet18",
        )
    extra = {"aux_logits": False} if name in _NO_AUX else {}
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)


def build_model(name: str, num_classes: int, width: int = 0) -> nn.Module:
    """A built-in name, `torchvision.<name>`, or a plug-in `pkg.module:factory` (torchlaunch/worker/plugins.py)."""
    if is_plugin(name):
        from torchlaunch.worker import plugins

        return plugins.build_model(name, num_classes, width)
    if name.startswith(TORCHVISION_PREFIX):
        return torchvision_model(name.removeprefix(TORCHVISION_PREFIX), num_classes, width)
    if name not in REGISTRY:
        raise ConfigError("model.name", f"unknown model {name!r}", f"choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name](num_classes, width)
