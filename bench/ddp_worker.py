"""One rank of the DDP benchmark (run by torchrun): the project's Trainer on the process group from
the env contract, the same per-step agreement all-reduce as Trainer.fit, rank 0 prints JSON."""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time

import torch

from torchlaunch import config as config_mod
from torchlaunch.core import dist
from torchlaunch.core.preemption import PreemptionWatcher
from torchlaunch.worker.data import load_bundle
from torchlaunch.worker.trainer import Trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="fastnet")
    p.add_argument("--per-rank-batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--plain-gloo",
        action="store_true",
        help="the fast paths off: no CPU pinning, gradients over gloo's TCP all-reduce",
    )
    p.add_argument("--set", nargs="*", default=[], help="more recipe keys KEY=VALUE (bench/exact.py)")
    args = p.parse_args()
    ctx = dist.setup(120.0, pin_cpus=not args.plain_gloo)
    per_rank = args.per_rank_batch
    global_batch = per_rank * ctx.world_size
    cfg = config_mod.load(
        None,
        [
            f"run_dir={tempfile.mkdtemp(prefix='bench-ddp-')}",
            f"model.name={args.model}",
            "data.name=synthetic",
            f"data.synthetic_train_size={global_batch * 4}",
            "data.synthetic_val_size=64",
            f"train.batch_size={global_batch}",
            "train.precision=bf16",
            "train.channels_last=true",
            "train.epochs=100000",
            "debug.check_model=false",
            f"dist.shared_memory_reduce={str(not args.plain_gloo).lower()}",
            *args.set,
        ],
    )
    trainer = Trainer(cfg, ctx, load_bundle(cfg.data), PreemptionWatcher([]))
    stream = itertools.chain.from_iterable(trainer.loader.epoch(e, 0) for e in itertools.count())
    for _ in range(args.warmup):
        trainer.train_step(next(stream)[1])
    dist.barrier(ctx)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = trainer.train_step(next(stream)[1])
        dist.all_reduce_max(ctx, [0.0, 0.0 if loss == loss else 1.0])
    dist.barrier(ctx)
    seconds = time.perf_counter() - start
    if ctx.is_main:
        print(
            json.dumps(
                {
                    "world_size": ctx.world_size,
                    "images_per_s": args.steps * global_batch / seconds,
                    "threads": torch.get_num_threads(),
                    "gradients": trainer.gradient_path,
                }
            ),
            flush=True,
        )
    dist.teardown(ctx)


if __name__ == "__main__":
    main()
