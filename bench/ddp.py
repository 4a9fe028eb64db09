"""DDP on gloo: 2 ranks x 1 thread ÷ 1 rank x 1 thread, images/s with real torchrun, weak scaling
(same per-rank batch), the project's Trainer in every rank; runs alternate 1, 2, 2, 1, ...

Also kept measured: the CPU fast paths adopted for 2 ranks on one machine (pinned ranks, gradients
through shared memory: train/affinity.py, train/shm_reduce.py) ÷ the same 2 ranks without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.common import REPO, Result, median, median_ratio, paired_rates

COMMAND = "python -m bench.run --only ddp"


def torchrun(
    world: int,
    model: str,
    per_rank: int,
    steps: int,
    timeout_s: float = 300,
    plain: bool = False,
    keys: tuple[str, ...] = (),
) -> float:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(REPO),
    )
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "-m",
        "bench.ddp_worker",
        "--model",
        model,
        "--per-rank-batch",
        str(per_rank),
        "--steps",
        str(steps),
        *(["--plain-gloo"] if plain else []),
        *(["--set", *keys] if keys else []),
    ]
    out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["images_per_s"])
    raise RuntimeError(f"torchrun ({world} ranks) printed no result, exit {out.returncode}: {out.stderr[-800:]}")


def run(
    quick: bool = False, rounds: int = 3, model: str = "fastnet", per_rank: int = 128, steps: int = 16
) -> list[Result]:
    if quick:
        rounds, model, per_rank, steps = 1, "simple_cnn", 16, 2
    rates = paired_rates(
        {
            "2": lambda: torchrun(2, model, per_rank, steps),
            "1": lambda: torchrun(1, model, per_rank, steps),
            "2-plain": lambda: torchrun(2, model, per_rank, steps, plain=True),
        },
        rounds,
        warmup=0,
    )
    ratio, per_round = median_ratio(rates["2"], rates["1"])
    setup = (
        f"real torchrun --standalone, {model}, {per_rank} images per rank per step (weak scaling), bf16 + "
        f"channels_last, {steps} timed steps after 2 warm-up steps, {rounds} alternating rounds"
    )
    scaling = Result(
        key="ddp",
        title="DDP on gloo (images/s, 2 ranks x 1 thread ÷ 1 rank x 1 thread)",
        project=median(rates["2"]),
        baseline=median(rates["1"]),
        unit="images/s",
        ratio=ratio,
        goal=1.9,
        higher_is_better=True,
        command=COMMAND,
        project_label="2 ranks x 1 thread",
        baseline_label="1 rank x 1 thread",
        rounds=per_round,
        notes=f"{setup}; 2 ranks with the project's defaults: pinned to one core each, gradients averaged "
        f"through shared memory",
    )
    adopted_ratio, adopted_rounds = median_ratio(rates["2"], rates["2-plain"])
    adopted = Result(
        key="adopted_cpu_ddp",
        title="Adopted: 2 ranks pinned + shared-memory gradients ÷ unpinned + gloo all-reduce (images/s)",
        project=median(rates["2"]),
        baseline=median(rates["2-plain"]),
        unit="images/s",
        ratio=adopted_ratio,
        goal=1.0,
        higher_is_better=True,
        command=COMMAND,
        project_label="dist.pin_cpus=true, dist.shared_memory_reduce=true (defaults)",
        baseline_label="both false: unpinned ranks, gloo's TCP ring all-reduce",
        rounds=adopted_rounds,
        notes=f"{setup}; same bits either way (tests/integration/test_gradient_paths_shm.py)",
    )
    return [scaling, adopted]
