"""AMP on CPU: the project's train_step with bf16 autocast + channels_last ÷ the same with fp32
(resnet18 with the CIFAR stem, same batches, steps interleaved one by one)."""

from __future__ import annotations

import itertools

import torch

from bench.common import Result, interleaved_steps, median, median_ratio
from bench.harness import make_trainer

COMMAND = "python -m bench.run --only amp"


def run(quick: bool = False, groups: int = 5, per_group: int = 2, batch: int = 64, model: str = "resnet18") -> Result:
    if quick:
        groups, per_group, batch, model = 2, 1, 16, "simple_cnn"
    common = [
        f"model.name={model}",
        "data.name=synthetic",
        f"data.synthetic_train_size={batch * 4}",
        "data.synthetic_val_size=64",
        f"train.batch_size={batch}",
        "train.epochs=100000",
    ]
    fast = make_trainer(common + ["train.precision=bf16", "train.channels_last=true"])
    slow = make_trainer(common + ["train.precision=fp32", "train.channels_last=false"], bundle=fast.data)

    def stepper(trainer):
        stream = itertools.chain.from_iterable(trainer.loader.epoch(e, 0) for e in itertools.count())
        return lambda: trainer.train_step(next(stream)[1])

    rate_fast, rate_slow = interleaved_steps(stepper(fast), stepper(slow), groups, per_group)
    ratio, per_round = median_ratio(rate_fast, rate_slow)
    return Result(
        key="amp",
        title="AMP on CPU (steps/s, bf16 + channels_last ÷ fp32)",
        project=median(rate_fast) * batch,
        baseline=median(rate_slow) * batch,
        unit="images/s",
        ratio=ratio,
        goal=2.0,
        higher_is_better=True,
        command=COMMAND,
        project_label="bf16 autocast + channels_last",
        baseline_label="fp32, contiguous",
        rounds=per_round,
        notes=f"{model}, batch {batch}, the project's Trainer.train_step both sides, {groups} groups of {per_group} "
        f"interleaved step pairs, {torch.get_num_threads()} torch thread(s); the issue's reference: 2.44x on "
        f"a bare loop (goal set at 2.0 here)",
    )
