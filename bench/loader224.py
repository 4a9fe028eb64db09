"""ImageNet-style loading at 224 px: the project's loaders with data.train_crop=resized (a shard set,
and the per-file ImageFolder path) ÷ torchvision's reference way (torchvision.datasets.ImageFolder +
PIL + transforms.RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize in DataLoader
workers: its reference preset, handing over the normalised float tensor the project's loader hands over),
over the same generated JPEGs (ImageNet-like sizes: 500x375 and other shapes, quality 90), images per core: every
side runs with the same number of DataLoader workers, and the rate is images per CPU-second spent by
the bench process and its workers together (workers are joined after each epoch, so their CPU time is
counted): on a box shared with other jobs this moves far less than wall time, which is kept beside it
(images/s per worker). Also the first batch, in seconds from loader construction (the shard set's open,
or ImageFolder's scan, included) to the first batch in hand, and from a fresh process's start."""

from __future__ import annotations

import itertools
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.common import REPO, Result, median, median_ratio, paired_rates
from torchlaunch import config as config_mod
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.worker.data import Normalizer, TrainLoader, load_bundle

COMMAND = "python -m bench.run --only loader224"
SHAPES = [(500, 375), (375, 500), (500, 333), (640, 480), (400, 400), (800, 600)]


def window_state() -> str:
    """Whether the shard loader's JPEG window decoder is in use here (built and giving PIL's pixels): an
    install without it measures the whole-image decode instead."""
    from torchlaunch.worker.data import jpeg

    if jpeg.window_decoder() is None:
        return "not built or not usable here: whole-image tensor decode measured"
    return "in use (each member's first draw decodes to its end marker, later draws stop after the box)"


def cpu_seconds() -> float:
    """CPU time of this process plus its terminated, joined children (DataLoader workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def write_jpegs(root: Path, classes: int, per_class: int) -> Path:
    """Smooth random scenes plus noise (compress and decode like photos, unlike pure noise)."""
    if (root / f"c{classes - 1}" / f"{per_class - 1:04d}.jpg").is_file():
        return root
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = SHAPES[(c + i) % len(SHAPES)]
            coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
            pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-20, 21, (h, w, 3))
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(root / f"c{c}" / f"{i:04d}.jpg", quality=90)
    return root


def shard_set(images: Path, out: Path) -> Path | None:
    if (out / "manifest.json").is_file():
        return out
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.shards",
            "write",
            "--from",
            str(images),
            "--out",
            str(out),
            "--val-fraction",
            "0.05",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return out if done.returncode == 0 else None


def project_loader(name: str, root: Path, batch: int, workers: int, cache: Path) -> TrainLoader:
    overrides = [f"data.name={name}", f"data.root={root}", "data.image_size=224", "data.train_crop=resized"]
    loader_only = ["model.name=resnet18"]  # no model is built; the default simple_cnn takes only 32-39 px
    cfg = config_mod.load(
        None, [*overrides, *loader_only, "data.loader=pil", f"data.cache_dir={cache}", "data.val_fraction=0.05"]
    )
    bundle = load_bundle(cfg.data)
    plan = BatchPlan(len(bundle.train), batch, seed=0, train_crop="resized", image_size=224)
    norm = Normalizer(bundle.mean, bundle.std, torch.device("cpu"), False)
    return TrainLoader(bundle.train, plan, norm, torch.device("cpu"), True, workers, 224)


def reference_loader(root: Path, batch: int, workers: int):
    import torchvision
    from torchvision import transforms as T

    # torchvision's reference preset (references/classification/presets.py, ClassificationPresetTrain):
    # the normalised float tensor the model gets, as the project's loader hands over.
    tf = T.Compose(
        [
            T.RandomResizedCrop(224),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
        ]
    )
    ds = torchvision.datasets.ImageFolder(str(root), transform=tf)
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)


FIRST_BATCH = """
import sys, time
from pathlib import Path
import torch
from bench.loader224 import project_loader
loader = project_loader("shards", Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
next(iter(loader.epoch(0, 0)))
print("first-batch", flush=True)
"""
"""A fresh process: import torch and the project, open the shard set, build the training loader (the
normalisation's probe included), fork the workers, take the first batch of epoch 0."""


def from_process_start(argv: list[str]) -> float:
    """Seconds from spawning `python argv` to its first output line (the process start counted)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"bench loader224: first-batch process failed: {done.stderr[-500:]}")
    return time.perf_counter() - start


def first_batch_result(shards: Path, batch: int, workers: int, cache: Path, rounds: int) -> Result:
    """The issue's "first batch after start <= 5 s from local disk": process start -> first training batch
    in hand (median of fresh processes), beside `python -c "import torch"` in the same rounds."""
    sides = {
        "first": lambda: from_process_start(["-c", FIRST_BATCH, str(shards), str(batch), str(workers), str(cache)]),
        "torch": lambda: from_process_start(["-c", "import torch"]),
    }
    times = paired_rates(sides, rounds)
    first, torch_s = median(times["first"]), median(times["torch"])
    return Result(
        key="first_batch",
        title="First training batch after process start (shard set, 224 px resized crop) ÷ the 5 s budget",
        project=first,
        baseline=5.0,
        unit="s",
        ratio=first / 5.0,
        goal=1.0,
        higher_is_better=False,
        command=COMMAND,
        project_label="fresh process: import, ShardSet.open, load_bundle (stats probe), TrainLoader, workers, batch",
        baseline_label="the issue's budget",
        rounds=[t / 5.0 for t in times["first"]],
        notes=f"batch {batch}, {workers} DataLoader workers, generated JPEGs on local disk, median of {rounds} fresh "
        f'processes; `python -c "import torch"` alone in the same rounds: {torch_s:.2f} s '
        f"(the rest, the project's part: {first - torch_s:.2f} s); the shards in the page cache (local disk, warm)",
        extra={"import_torch_s": torch_s},
    )


def run(
    quick: bool = False, work: Path | None = None, rounds: int = 5, batch: int = 32, workers: int = 2
) -> list[Result] | None:
    work = work or Path(tempfile.mkdtemp(prefix="bench-224-"))
    classes, per_class = (4, 16) if quick else (10, 64)
    if quick:
        rounds, workers = 1, 0
    images = write_jpegs(work / "jpegs", classes, per_class)
    shards = shard_set(images, work / "shards224")  # not work/shards: bench.shards works there
    if shards is None:
        return None
    steps = (classes * per_class * 9 // 10) // batch
    epochs = itertools.count()
    procs = max(1, workers)
    wall: dict[str, list[float]] = {"shards": [], "files": [], "reference": []}

    def timed(side: str, take: Callable[[], int]) -> float:
        """images per CPU-second of every process doing the work (this one + its joined DataLoader
        workers): the per-core rate, which other jobs on a shared box change far less than wall time.
        The wall-clock rate per worker is kept beside it."""
        start, cpu = time.perf_counter(), cpu_seconds()
        n = take()
        wall[side].append(n / (time.perf_counter() - start) / procs)
        return n / (cpu_seconds() - cpu)

    def project(name: str, root: Path):
        loader = project_loader(name, root, batch, workers, work / "cache")

        def take() -> int:
            n, epoch = 0, loader.epoch(next(epochs), 0)
            for _, micro in itertools.islice(epoch, steps):
                n += sum(x.shape[0] for x, _ in micro)
            epoch.close()  # drops the DataLoader iterator: its workers are joined (their CPU time counted)
            return n

        return lambda: timed("files" if name == "imagefolder" else "shards", take)

    def reference() -> float:
        def take() -> int:
            n = 0
            for x, _ in itertools.islice(reference_loader(images, batch, workers), steps):
                n += x.shape[0]
            return n  # the loop's iterator is dropped here: its workers are joined

        return timed("reference", take)

    def first_batch(make) -> float:
        start = time.perf_counter()
        next(iter(make()))
        return time.perf_counter() - start

    first_shards = first_batch(
        lambda: (m for _, m in project_loader("shards", shards, batch, workers, work / "c").epoch(0, 0))
    )
    first_reference = first_batch(lambda: reference_loader(images, batch, workers))
    sides = {"shards": project("shards", shards), "files": project("imagefolder", images), "reference": reference}
    rates = paired_rates(sides, rounds)
    ratio, per_round = median_ratio(rates["shards"], rates["reference"])
    files_ratio, _ = median_ratio(rates["files"], rates["reference"])
    wall_ratio, wall_rounds = median_ratio(wall["shards"][-rounds:], wall["reference"][-rounds:])
    first_start = first_batch_result(shards, batch, workers, work / "cache-first", rounds)
    return [
        first_start,
        Result(
            key="loader224",
            title="ImageNet-style loading at 224 px (images/s per core, shard loader ÷ torchvision reference)",
            project=median(rates["shards"]),
            baseline=median(rates["reference"]),
            unit="images per CPU-second",
            ratio=ratio,
            goal=1.5,
            higher_is_better=True,
            command=COMMAND,
            project_label="shards + RandomResizedCrop (plan variates, JPEG window decode or draft) + flip",
            baseline_label="ImageFolder + PIL + RandomResizedCrop(224) + flip + ToTensor + Normalize",
            rounds=per_round,
            notes=f"{classes * per_class} generated JPEGs ({', '.join(f'{w}x{h}' for w, h in SHAPES)}), batch {batch}, "
            f"{workers} DataLoader workers each side, {rounds} interleaved rounds; per core = per CPU-second of the "
            f"bench process and its (joined) workers; by wall clock per worker instead: {wall_ratio:.2f} (per round: "
            f"{', '.join(f'{r:.2f}' for r in wall_rounds)}); the per-file ImageFolder path of the "
            f"project: {median(rates['files']):,.1f} images per CPU-second ({files_ratio:.2f}x the reference); first batch "
            f"from loader construction: shards {first_shards:.2f} s, reference {first_reference:.2f} s; the JPEG window "
            f"decoder (setup.py's optional C extension) {window_state()}",
            extra={
                "files_images_per_s_per_core": median(rates["files"]),
                "files_ratio": files_ratio,
                "first_batch_s": {"shards": first_shards, "reference": first_reference},
            },
        ),
    ][::-1]


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv) or []:
        print(r)
