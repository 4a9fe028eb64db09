"""The same training with a PyTorch Lightning Trainer (benchmark venv only): ImageFolder + PIL
transforms, the model from peer_reference.build (stock resnet18 by default, or resnet18-cifar) in
channels_last, bf16-mixed, DDP on CPU processes. With --val, the epoch ends with a validation pass over
that folder (loss and top-1 logged with sync_dist, as a Lightning user writes it); the pre-training
sanity check is off (num_sanity_val_steps=0: its fastest setting)."""

from __future__ import annotations

import argparse
import json
import time

import lightning as L
import torch
from torch import nn

from bench.peer_reference import MEAN, MODELS, STD, build


class Module(L.LightningModule):
    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = build(model).to(memory_format=torch.channels_last)
        self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch, _):
        x, y = batch
        return self.criterion(self.model(x.contiguous(memory_format=torch.channels_last)), y)

    def validation_step(self, batch, _):
        x, y = batch
        logits = self.model(x.contiguous(memory_format=torch.channels_last))
        self.log("val_loss", self.criterion(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def main() -> None:
    import torchvision
    from torchvision import transforms as T

    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val", default=None, help="validation image folder, evaluated at the end of each epoch")
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--model", choices=MODELS, default="resnet18", help="resnet18 = stock torchvision model")
    p.add_argument(
        "--save",
        default=None,
        help="default_root_dir: Lightning's default end-of-epoch checkpoint goes there (none without it)",
    )
    args = p.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(max(1, 2 // args.devices))
    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(args.data, transform=tf)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=args.batch // args.devices,
        shuffle=True,
        num_workers=args.workers,
        drop_last=True,
        persistent_workers=args.workers > 0,
    )
    val_loader = None
    if args.val:
        val_ds = torchvision.datasets.ImageFolder(
            args.val, transform=T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)]), allow_empty=True
        )  # a small split can miss a class
        val_loader = torch.utils.data.DataLoader(
            val_ds, batch_size=args.batch // args.devices, num_workers=args.workers
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision="bf16-mixed",
        max_epochs=1,
        logger=False,
        enable_checkpointing=bool(args.save),
        default_root_dir=args.save,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(args.model), loader, val_loader)
    if trainer.global_rank == 0:
        print(json.dumps({"seconds": time.perf_counter() - start, "steps": trainer.global_step}), flush=True)


if __name__ == "__main__":
    main()
