"""Loop overhead: the project's Trainer.train_step fed by TrainLoader ÷ a bare PyTorch loop.

Same model (fastnet, same init), same precision (bf16 autocast + channels_last), same batches: the
bare loop gets the batches the project's TrainLoader produces, already augmented and normalized in
memory, so the figure isolates what the project adds per step (loader indexing + augmentation, the
agreement all-reduce is a no-op on one rank, LR scheduler, finite check)."""

from __future__ import annotations

import copy
import itertools

import torch

from bench.common import Result, interleaved_steps, median, median_ratio
from bench.harness import bare_step_fn, make_trainer

COMMAND = "python -m bench.run --only loop"


def run(quick: bool = False, groups: int = 7, per_group: int = 6, batch: int = 128, model: str = "fastnet") -> Result:
    if quick:
        groups, per_group, batch, model = 2, 2, 32, "simple_cnn"
    steps = groups * per_group + 1
    trainer = make_trainer(
        [
            f"model.name={model}",
            "data.name=synthetic",
            f"data.synthetic_train_size={batch * steps}",
            "data.synthetic_val_size=64",
            f"train.batch_size={batch}",
            "train.precision=bf16",
            "train.channels_last=true",
            "optim.lr=0.05",
            "optim.weight_decay=5e-4",
            "train.epochs=1000",
        ]
    )
    bare_model = copy.deepcopy(trainer.model)
    bare_step = bare_step_fn(bare_model, torch.bfloat16, lr=0.05)
    # The bare loop's batches: exactly what the project's loader yields, materialised up front.
    batches = [micro[0] for _, micro in trainer.loader.epoch(1, 0)]
    stream = itertools.chain.from_iterable(trainer.loader.epoch(e, 0) for e in itertools.count(2))
    cursor = itertools.cycle(batches)

    def project() -> None:
        _, micro = next(stream)
        trainer.train_step(micro)

    def bare() -> None:
        bare_step(*next(cursor))

    rate_p, rate_b = interleaved_steps(project, bare, groups, per_group)
    ratio, per_round = median_ratio(rate_p, rate_b)
    return Result(
        key="loop",
        title="Loop overhead (steps/s, project ÷ bare loop)",
        project=median(rate_p),
        baseline=median(rate_b),
        unit="steps/s",
        ratio=ratio,
        goal=0.97,
        higher_is_better=True,
        command=COMMAND,
        project_label="Trainer.train_step + TrainLoader",
        baseline_label="bare loop, batches in memory",
        rounds=per_round,
        notes=f"{model}, batch {batch}, bf16 autocast + channels_last, steps interleaved one by one, "
        f"{groups} groups of {per_group} step pairs, {torch.get_num_threads()} torch thread(s)",
    )
