"""A PyTorch Lightning DDP script as its users write it: nothing of torchlaunch imported.

`lightning_ddp.py RUN_DIR [--epochs N]`: a small classifier on a fixed synthetic set, DDP on CPU over
gloo with as many processes per node as the launcher started (Lightning reads the torchrun or Slurm
environment itself), a `last.ckpt` every few steps, and `ckpt_path="last"` so a rerun resumes from
Lightning's own checkpoint. Rank 0 writes RUN_DIR/result.json at the end: the global step reached,
the epochs seen and whether the run resumed.
"""

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps-per-epoch", type=int, default=40)
    args = p.parse_args()
    run = Path(args.run_dir)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps_per_epoch * 8 * 4, 16, generator=gen)
    y = (x[:, :4].argmax(dim=1)).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    every = ModelCheckpoint(dirpath=run / "ckpt", save_last=True, every_n_train_steps=5, save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
        max_epochs=args.epochs,
        default_root_dir=str(run),
        callbacks=[every],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    last = run / "ckpt" / "last.ckpt"
    resumed = last.is_file()
    trainer.fit(Net(), loader, ckpt_path="last" if resumed else None)
    if trainer.global_rank == 0:
        (run / "result.json").write_text(
            json.dumps({"global_step": trainer.global_step, "epochs": trainer.current_epoch, "resumed": resumed})
        )


if __name__ == "__main__":
    main()
