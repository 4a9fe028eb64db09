"""ImageNet-scale loading on one GPU (issue 27's two GPU rows); without CUDA it is skipped, saying so:

1. GPU decode alone: torchvision.io.decode_jpeg(list, device=cuda) of a step's worth of generated
   ImageNet-like JPEGs (500x375 and other shapes, quality 90, read from a shard set), images/s ÷
   torchvision's published batched-decode figure on an A100 (7,800 images/s, the issue's goal); the
   same plus the batched RandomResizedCrop to 224 (gpu_decode.resized_crops) beside it.
2. End to end: the project's Trainer, torchvision.resnet50, bf16 autocast + channels_last, batch 256 at
   224 px, on the shard set with data.train_crop=resized and data.decode=gpu ÷ the same Trainer on
   data.name=synthetic (the uint8 set resident on the GPU: no loading at all), interleaved rounds of
   timed steps after a warm-up. Goal >= 0.9 and >= 2,500 images/s (NVIDIA's DALI figure on an A100).
   The data.decode=cpu rate (8 DataLoader workers) is reported beside it.

    python -m bench.run --only gpu224     # where a GPU is lent (docs/GPU.md); writes docs/BENCHMARKS.md
    python -m bench.gpu224 --dry-run      # here: the same code on the CPU at tiny sizes, figures meaningless
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Result, median, median_ratio, paired_rates
from bench.loader224 import shard_set, write_jpegs

COMMAND = "python -m bench.run --only gpu224"
TV_A100_DECODE = 7_800.0
"""torchvision's batched decode_jpeg(device="cuda") figure on an A100, images/s (the issue's goal)."""
DALI_A100_RESNET50 = 2_500.0
"""The issue's absolute floor for ResNet-50 AMP end to end (NVIDIA's DALI figure on an A100: 2,470)."""
SKIP = "no CUDA device here: data.decode=gpu and ResNet-50 at 224 px need one (run `{}` where a GPU is lent)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rates(shards: Path, device: torch.device, batch: int, rounds: int) -> dict[str, list[float]]:
    """images/s of the batched decode alone, and of decode + resized crop to 224, on `device`."""
    import numpy as np

    from torchlaunch.core.sampler import BatchPlan
    from torchlaunch.data.shards import ShardSet
    from torchlaunch.worker.data import gpu_decode
    from torchlaunch.worker.data.augment import resized_crop_box

    ss = ShardSet.open(shards / "train")
    n = min(batch, len(ss))
    encoded = [torch.frombuffer(bytearray(ss.read(i)), dtype=torch.uint8) for i in range(n)]
    where = [ss.where(i) for i in range(n)]
    plan = BatchPlan(len(ss), n, 0, train_crop="resized", image_size=224)
    variates = plan.rank_step(plan.permutation(0), 0, 0)[1][0].numpy()
    boxes = torch.tensor([resized_crop_box(variates[k], *map(int, ss.sizes[k])) for k in range(n)], dtype=torch.float64)
    flips = torch.from_numpy(np.arange(n) % 2 == 0)

    def decode() -> float:
        _sync(device)
        start = time.perf_counter()
        gpu_decode.decode_batch(encoded, where, device)
        _sync(device)
        return n / (time.perf_counter() - start)

    def decode_crop() -> float:
        _sync(device)
        start = time.perf_counter()
        gpu_decode.resized_crops(gpu_decode.decode_batch(encoded, where, device), boxes, flips, 224)
        _sync(device)
        return n / (time.perf_counter() - start)

    return paired_rates({"decode": decode, "decode_crop": decode_crop}, rounds, warmup=2)


def trainer_for(data: list[str], model: str, batch: int, size: int, device: torch.device, workers: int):
    from torchlaunch import config as config_mod
    from torchlaunch.core.dist import DistContext
    from torchlaunch.core.preemption import PreemptionWatcher
    from torchlaunch.worker.data import load_bundle
    from torchlaunch.worker.trainer import Trainer

    cfg = config_mod.load(
        None,
        [
            f"run_dir={tempfile.mkdtemp(prefix='bench-gpu224-')}",
            f"model.name={model}",
            f"data.image_size={size}",
            f"data.num_workers={workers}",
            f"train.batch_size={batch}",
            "train.micro_batch_size=0",
            f"train.precision={'bf16' if device.type == 'cuda' else 'fp32'}",
            f"train.channels_last={'true' if device.type == 'cuda' else 'false'}",
            "train.epochs=1000",
            "debug.check_model=false",
            *data,
        ],
    )
    return Trainer(cfg, DistContext(device=device), load_bundle(cfg.data), PreemptionWatcher([]))


def step_rate(trainer, batch: int, steps: int, device: torch.device):
    """A callable that times `steps` training steps (loading included) on a stream that never ends."""
    stream = itertools.chain.from_iterable(trainer.loader.epoch(e, 0) for e in itertools.count())

    def measure() -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(next(stream)[1])
        _sync(device)
        return steps * batch / (time.perf_counter() - start)

    return measure


def run(quick: bool = False, work: Path | None = None, dry_run: bool = False) -> list[Result] | None:
    """The two figures on CUDA; None (after saying why) without it. `dry_run` runs the same code on the
    CPU at tiny sizes (the gpu decode path through TrainLoader, decode_jpeg with device=cpu)."""
    cuda = torch.cuda.is_available()
    if not cuda and not dry_run:
        print(f"bench gpu224: skipped: {SKIP.format(COMMAND)}", file=sys.stderr)
        return None
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    small = dry_run or quick
    work = work or Path(tempfile.mkdtemp(prefix="bench-gpu224-"))
    classes, per_class = (4, 8) if small else (20, 128)
    batch, size, steps, rounds = (8, 64, 2, 1) if small else (256, 224, 10, 3)
    model = "torchvision.resnet18" if small else "torchvision.resnet50"
    images = write_jpegs(work / f"jpegs-{classes}x{per_class}", classes, per_class)
    shards = shard_set(images, work / f"shards-{classes}x{per_class}")
    if shards is None:
        print("bench gpu224: skipped: the shard writer failed on the generated JPEGs", file=sys.stderr)
        return None
    decode = decode_rates(shards, device, batch, rounds)

    shard_data = ["data.name=shards", f"data.root={shards}", "data.train_crop=resized"]
    synthetic = [
        "data.name=synthetic",
        f"data.synthetic_train_size={classes * per_class}",
        "data.synthetic_val_size=64",
        f"data.synthetic_classes={classes}",
    ]
    gpu_trainer = trainer_for(
        [*shard_data, f"data.decode={'gpu' if cuda else 'cpu'}"], model, batch, size, device, 8 if cuda else 2
    )
    if not cuda:  # the dry run: the gpu path itself on the CPU (the constructor refuses a CPU device)
        gpu_trainer.loader.decode = "gpu"
    sides = {
        "shards_gpu": step_rate(gpu_trainer, batch, steps, device),
        "synthetic": step_rate(trainer_for(synthetic, model, batch, size, device, 0), batch, steps, device),
        "shards_cpu": step_rate(
            trainer_for([*shard_data, "data.decode=cpu"], model, batch, size, device, 8 if cuda else 2),
            batch,
            steps,
            device,
        ),
    }
    rates = paired_rates(sides, rounds)
    ratio, per_round = median_ratio(rates["shards_gpu"], rates["synthetic"])
    cpu_ratio, _ = median_ratio(rates["shards_cpu"], rates["synthetic"])
    where = "dry run on the CPU, figures meaningless; " if not cuda else ""
    precision = "bf16 + channels_last" if cuda else "fp32"
    workers = 8 if cuda else 2
    e2e = median(rates["shards_gpu"])
    return [
        Result(
            key="gpu_decode",
            title="One GPU: batched decode_jpeg(device=cuda) images/s ÷ torchvision's A100 figure (7,800)",
            project=median(decode["decode"]),
            baseline=TV_A100_DECODE,
            unit="images/s",
            ratio=median(decode["decode"]) / TV_A100_DECODE,
            goal=1.0,
            higher_is_better=True,
            command=COMMAND,
            project_label="torchvision.io.decode_jpeg(list of encoded members, device=cuda), one call per batch",
            baseline_label="torchvision's published batched GPU decode on an A100",
            rounds=[r / TV_A100_DECODE for r in decode["decode"]],
            notes=f"{where}{batch} generated ~500x375 JPEGs (quality 90) per call from a shard set, {rounds} rounds; "
            f"decode + RandomResizedCrop to 224 on the device: {median(decode['decode_crop']):,.0f} images/s",
            extra={"decode_crop_images_per_s": median(decode["decode_crop"])},
        ),
        Result(
            key="gpu_e2e",
            title="One GPU: ResNet-50 AMP 224 px training on shards (data.decode=gpu) ÷ on synthetic in-GPU data",
            project=e2e,
            baseline=median(rates["synthetic"]),
            unit="images/s",
            ratio=ratio,
            goal=0.9,
            higher_is_better=True,
            command=COMMAND,
            project_label="Trainer on shards, train_crop=resized, data.decode=gpu (8 workers read bytes)",
            baseline_label="the same Trainer on data.name=synthetic (uint8 set on the GPU)",
            rounds=per_round,
            notes=f"{where}{model}, batch {batch}, {size} px, {precision}, {steps} timed steps per round, "
            f"{rounds} interleaved rounds, {classes * per_class} generated JPEGs; absolute: {e2e:,.0f} images/s "
            f"(goal >= {DALI_A100_RESNET50:,.0f}: {'met' if e2e >= DALI_A100_RESNET50 else 'not met'}); "
            f"data.decode=cpu with {workers} workers: {median(rates['shards_cpu']):,.0f} images/s ({cpu_ratio:.2f}x synthetic)",
            extra={
                "images_per_s": e2e,
                "cpu_decode_ratio": cpu_ratio,
                "cpu_decode_images_per_s": median(rates["shards_cpu"]),
            },
        ),
    ]


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv, dry_run="--dry-run" in sys.argv) or []:
        print(f"{r.key}: {r.project:,.1f} {r.unit} / {r.baseline:,.1f} = {r.ratio:.3g} (goal {r.goal}) {r.notes}")
