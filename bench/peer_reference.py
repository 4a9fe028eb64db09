"""A minimal equivalent of the CPU code path of torchvision's reference classification train.py
(references/classification/train.py, not shipped in any package and not fetchable here): ImageFolder +
PIL transforms + DataLoader + SGD(momentum 0.9, wd 1e-4), one process, written for this benchmark.
Prints one JSON line with the wall time of the epoch loop.

--model resnet18 is torchvision's stock ResNet-18 (ImageNet stem: 7x7 stride-2 conv + max-pool), the
model the issue's peer figures were measured with and what the reference script builds;
--model resnet18-cifar is the CIFAR-stem variant (3x3 stride-1, no max-pool: ~16x the compute per
32x32 image, so every system is compute-bound and they all run at about the same speed)."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torchvision
from torch import nn
from torchvision import transforms as T

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def cifar_resnet18() -> nn.Module:
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


MODELS = ("resnet18", "resnet18-cifar", "tiny")


def build(name: str) -> nn.Module:
    """`resnet18` (stock) or `resnet18-cifar` for the benchmark; `tiny` only for the machinery's smoke test."""
    if name == "tiny":
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 10))
    if name == "resnet18-cifar":
        return cifar_resnet18()
    if name == "resnet18":
        return torchvision.models.get_model("resnet18", weights=None, num_classes=10)
    raise ValueError(f"unknown model {name!r} (choose one of: {', '.join(MODELS)})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", choices=MODELS, default="resnet18", help="resnet18 = stock torchvision model")
    p.add_argument("--save", default=None, help="folder for the end-of-epoch checkpoint (model + optimizer), "
                   "as the reference script writes with --output-dir")
    p.add_argument("--bf16-channels-last", action="store_true",
                   help="more than the reference does on CPU: bf16 autocast + channels_last")
    args = p.parse_args()
    start = time.perf_counter()
    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(args.data, transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                         drop_last=True)
    model = build(args.model)
    fmt = torch.channels_last if args.bf16_channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss()
    model.train()
    seen = 0
    for x, y in loader:
        x = x.contiguous(memory_format=fmt)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_channels_last):
            loss = criterion(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += x.shape[0]
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 0},
                   f"{args.save}/checkpoint.pth")
    print(json.dumps({"images": seen, "seconds": time.perf_counter() - start, "loss": float(loss)}), flush=True)


if __name__ == "__main__":
    main()
