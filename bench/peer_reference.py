"""A minimal equivalent of the CPU code path of torchvision's reference classification train.py
(references/classification/train.py, not shipped in any package and not fetchable here), written for
this benchmark. It does the work that script does, in the same places, and no more:
- per step: forward, zero_grad, loss, backward, SGD(momentum 0.9, wd 1e-4) step, then top-1/top-5
  accuracy of the step's output and the metric updates (`loss.item()`, `acc1.item()`, `acc5.item()`, the
  LR and an images/s meter), a log line every --print-freq steps (the script's default: 10);
- per epoch: the LR scheduler's step (StepLR, the script's default), evaluation over the val folder
  (`--val`, the script's DATA/val: loss, top-1, top-5 under inference_mode, its own DataLoader with the
  same workers), and with an output folder (`--save`) the checkpoint written twice, as model_{epoch}.pth
  and checkpoint.pth (model, optimizer, lr_scheduler, epoch; the script also pickles its argparse
  Namespace there, which is why its --resume fails under weights_only=True: left out here).
ImageFolder + PIL transforms + DataLoader, one process. Prints one JSON line with the wall time.

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
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
        )
    if name == "resnet18-cifar":
        return cifar_resnet18()
    if name == "resnet18":
        return torchvision.models.get_model("resnet18", weights=None, num_classes=10)
    raise ValueError(f"unknown model {name!r} (choose one of: {', '.join(MODELS)})")


def topk_correct(output: torch.Tensor, target: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[torch.Tensor]:
    """Percent of rows whose target is among the k highest logits, for each k (capped at the class count)."""
    top = output.topk(min(max(ks), output.shape[1]), dim=1).indices
    hit = top == target[:, None]
    return [hit[:, :k].any(dim=1).float().mean() * 100 for k in ks]


class Meters:
    """Running sums of per-step scalars, printed every `every` steps: the reference script's MetricLogger
    reduced to the work it does per step (Python floats, one formatted line per print)."""

    def __init__(self, header: str, every: int) -> None:
        self.header, self.every, self.sums, self.counts, self.steps = header, every, {}, {}, 0

    def update(self, n: int = 1, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * n
            self.counts[key] = self.counts.get(key, 0) + n

    def step(self) -> None:
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            print(self.line(), flush=True)

    def line(self) -> str:
        return f"{self.header} [{self.steps}]  " + "  ".join(
            f"{k}: {self.sums[k] / self.counts[k]:.4f}" for k in self.sums
        )

    def mean(self, key: str) -> float:
        return self.sums[key] / self.counts[key]


def evaluate(model: nn.Module, criterion: nn.Module, loader, fmt: torch.memory_format, bf16: bool) -> float:
    model.eval()
    meters = Meters("Test:", every=100)
    with torch.inference_mode():
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                output = model(x.contiguous(memory_format=fmt))
                loss = criterion(output, y)
            acc1, acc5 = topk_correct(output, y)
            meters.update(loss=loss.item())
            meters.update(n=x.shape[0], acc1=acc1.item(), acc5=acc5.item())
            meters.step()
    print(f"Test: Acc@1 {meters.mean('acc1'):.3f} Acc@5 {meters.mean('acc5'):.3f}", flush=True)
    return meters.mean("acc1")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="training image folder (the script's DATA/train)")
    p.add_argument(
        "--val",
        default=None,
        help="validation image folder (the script's DATA/val), evaluated after each epoch as the script does",
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--print-freq", type=int, default=10)
    p.add_argument("--model", choices=MODELS, default="resnet18", help="resnet18 = stock torchvision model")
    p.add_argument(
        "--save",
        default=None,
        help="output folder: the end-of-epoch checkpoint (model + optimizer "
        "+ lr_scheduler), written as model_0.pth and checkpoint.pth as the script's --output-dir",
    )
    p.add_argument(
        "--bf16-channels-last",
        action="store_true",
        help="more than the reference does on CPU: bf16 autocast + channels_last",
    )
    args = p.parse_args()
    start = time.perf_counter()
    bf16 = args.bf16_channels_last
    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(args.data, transform=tf)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=args.batch, shuffle=True, num_workers=args.workers, drop_last=True
    )
    val_loader = None
    if args.val:
        val_ds = torchvision.datasets.ImageFolder(
            args.val, transform=T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)]), allow_empty=True
        )  # a small split can miss a class
        val_loader = torch.utils.data.DataLoader(val_ds, batch_size=args.batch, shuffle=False, num_workers=args.workers)
    model = build(args.model)
    fmt = torch.channels_last if bf16 else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
    criterion = nn.CrossEntropyLoss()
    model.train()
    meters = Meters("Epoch: [0]", every=args.print_freq)
    seen = 0
    for x, y in loader:
        step_start = time.time()
        x = x.contiguous(memory_format=fmt)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            output = model(x)
            loss = criterion(output, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc1, acc5 = topk_correct(output, y)
        meters.update(loss=loss.item(), lr=opt.param_groups[0]["lr"])
        meters.update(n=x.shape[0], acc1=acc1.item(), acc5=acc5.item())
        meters.update(images_per_s=x.shape[0] / max(time.time() - step_start, 1e-9))
        meters.step()
        seen += x.shape[0]
    scheduler.step()
    val_acc = evaluate(model, criterion, val_loader, fmt, bf16) if val_loader is not None else None
    if args.save:
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "epoch": 0,
        }
        for name in ("model_0.pth", "checkpoint.pth"):
            torch.save(checkpoint, f"{args.save}/{name}")
    print(
        json.dumps({"images": seen, "seconds": time.perf_counter() - start, "loss": float(loss), "val_acc": val_acc}),
        flush=True,
    )


if __name__ == "__main__":
    main()
