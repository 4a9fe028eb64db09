"""An HF Accelerate script as its users write it: nothing of torchlaunch imported.

`accelerate_train.py RUN_DIR [--epochs N]`: a small classifier on a fixed synthetic set; Accelerate
reads the torchrun or Slurm environment itself (CPU, gloo). `accelerator.save_state` every few steps
into RUN_DIR/state, `load_state` plus `skip_first_batches` on a rerun, and a SIGTERM handler that
saves the state and exits 75 (the scheduler's "run me again"), as the Accelerate docs suggest for
preemptible jobs. Rank 0 writes RUN_DIR/result.json at the end.
"""

import argparse
import json
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PREEMPTED = 75
stop = {"requested": False}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps-per-epoch", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    args = p.parse_args()
    run = Path(args.run_dir)
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps_per_epoch * 8 * accelerator.num_processes, 16, generator=gen)
    y = x[:, :4].argmax(dim=1).long()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state_dir = run / "state"
    progress = run / "progress.json"
    step, resumed = 0, False
    if progress.is_file():
        accelerator.load_state(str(state_dir))
        step, resumed = json.loads(progress.read_text())["step"], True
    per_epoch = len(loader)
    while step < per_epoch * args.epochs:
        epoch, start = divmod(step, per_epoch)
        batches = accelerator.skip_first_batches(loader, start) if start else loader
        for xb, yb in batches:
            loss = nn.functional.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            flag = torch.tensor([1.0 if stop["requested"] else 0.0])
            preempt = accelerator.reduce(flag, reduction="sum").item() > 0
            if preempt or step % args.save_every == 0:
                accelerator.save_state(str(state_dir))
                if accelerator.is_main_process:  # after the state: a rerun never skips unsaved steps
                    tmp = progress.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"step": step}))
                    tmp.replace(progress)
                accelerator.wait_for_everyone()
            if preempt:
                accelerator.end_training()
                sys.exit(PREEMPTED)
    if accelerator.is_main_process:
        (run / "result.json").write_text(json.dumps({"step": step, "epochs": args.epochs, "resumed": resumed}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
