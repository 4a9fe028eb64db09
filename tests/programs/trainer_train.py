"""`trainer_train.py RUN_DIR [--steps N]`: a Hugging Face `Trainer` script as users write it, with no
signal handler of its own and DataLoader workers (forked): it saves every 5 steps and resumes with
`resume_from_checkpoint` when RUN_DIR/out holds a checkpoint. Writes RUN_DIR/result.json at the end."""

import argparse
import json
import os
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": torch.nn.functional.cross_entropy(self.linear(x), labels)}


class Blobs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.tensor(i % 2)}


class Slow(TrainerCallback):
    """A step of real work takes time: the test preempts mid-run; RUN_DIR/step says how far it got."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - Trainer's signature
        time.sleep(0.2)
        with open(os.path.join(self.run_dir, "step"), "w") as f:
            f.write(str(state.global_step))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    out = os.path.join(a.run_dir, "out")
    resume = os.path.isdir(out) and any(n.startswith("checkpoint-") for n in os.listdir(out))
    args = TrainingArguments(
        output_dir=out,
        max_steps=a.steps,
        per_device_train_batch_size=8,
        save_steps=5,
        logging_steps=5,
        dataloader_num_workers=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Blobs(), callbacks=[Slow(a.run_dir)])
    trainer.train(resume_from_checkpoint=True if resume else None)
    with open(os.path.join(a.run_dir, "result.json"), "w") as f:
        json.dump({"resumed": resume, "global_step": trainer.state.global_step}, f)
