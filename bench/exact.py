"""train.exact (worker/grid.py) ÷ today's path: steady images/s of 2 CPU ranks x 1 thread with real
torchrun and the project's Trainer (bench/ddp_worker.py), the same global batch, runs alternating.
Today's path: DDP, one forward/backward of the rank's whole share, gradients through shared memory.
The grid: 8 micro-batches of batch/8 per step (4 per rank), each gradient kept, summed in fixed point
through shared memory (a MAX all-reduce of the scales and one barrier a step). Two models: the smoke
recipe's (simple_cnn, width 16) and resnet18, both at 32 px, fp32."""

from __future__ import annotations

from bench.common import Result, median, median_ratio, paired_rates
from bench.ddp import torchrun

COMMAND = "python -m bench.run --only exact"
MODELS = {"smoke": ("simple_cnn", ("model.width=16",)), "resnet18": ("resnet18", ())}
KEYS = ("train.precision=fp32", "train.channels_last=false")


def run(
    quick: bool = False, rounds: int = 3, per_rank: int = 64, steps: int = 6, models: tuple[str, ...] = tuple(MODELS)
) -> list[Result]:
    if quick:
        rounds, steps, models = 1, 2, ("smoke",)
    out = []
    for key in models:
        model, extra = MODELS[key]
        keys = (*KEYS, *extra)
        rates = paired_rates(
            {
                "exact": lambda m=model, k=keys: torchrun(2, m, per_rank, steps, keys=(*k, "train.exact=true")),
                "today": lambda m=model, k=keys: torchrun(2, m, per_rank, steps, keys=k),
            },
            rounds,
            warmup=0,
        )
        ratio, per_round = median_ratio(rates["exact"], rates["today"])
        out.append(
            Result(
                key=f"exact-{key}",
                title=f"train.exact ÷ today's path, {model} at 32 px (images/s, 2 ranks x 1 thread, CPU)",
                project=median(rates["exact"]),
                baseline=median(rates["today"]),
                unit="images/s",
                ratio=ratio,
                goal=0.97,
                higher_is_better=True,
                command=COMMAND,
                project_label="train.exact=true: 8 micro-batches, fixed-point sums in shared memory",
                baseline_label="train.exact=false: DDP, gradients through shared memory",
                rounds=per_round,
                notes=f"real torchrun --standalone, global batch {2 * per_rank}, fp32, {steps} timed steps after 2 "
                f"warm-up steps, {rounds} alternating rounds",
            )
        )
    return out
