"""Data path: the project's TrainLoader (uint8 cache + batched augmentation + normalize) ÷ torchvision
ImageFolder + PIL transforms through a DataLoader at its best worker count (0, 1, 2), both over the
shared CIFAR-10 JPEG copy. The decode cache is built once before timing (it is a one-off per dataset
and reported separately); the PIL path decodes JPEGs every epoch, as it does in real training."""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Result, median, median_ratio, paired_rates, subset_folder, unpacked_cifar
from torchlaunch import config as config_mod
from torchlaunch.worker.data import CROP_PADDING, BatchPlan, Normalizer, TrainLoader, load_bundle

COMMAND = "python -m bench.run --only datapath"


def pil_loader(root: Path, batch: int, workers: int, mean, std):
    import torchvision
    from torchvision import transforms as T

    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    ds = torchvision.datasets.ImageFolder(str(root), transform=tf)
    return torch.utils.data.DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True, persistent_workers=workers > 0
    )


def flat_gather_augment(images: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Proposed replacement for torchlaunch.worker.data.augment: the same crop + flip as ONE gather over the
    flattened padded image (bit-identical output, checked below), instead of 4-D advanced indexing."""
    n, c, h, w = images.shape
    p = CROP_PADDING
    padded = torch.nn.functional.pad(images, (p, p, p, p)).reshape(n, c, -1)
    device = images.device
    rows = dy.to(device)[:, None] + torch.arange(h, device=device)
    cols = dx.to(device)[:, None] + torch.arange(w, device=device)
    cols = torch.where(flip.to(device)[:, None], cols.flip(1), cols)
    flat = (rows[:, :, None] * (w + 2 * p) + cols[:, None, :]).reshape(n, 1, h * w).expand(n, c, h * w)
    return padded.gather(2, flat).reshape(n, c, h, w)


class ProposedLoader(TrainLoader):
    """TrainLoader with the two proposed changes: index_select instead of tensor[idx] for the batch
    gather, and flat_gather_augment instead of augment."""

    def epoch(self, epoch: int, start_step: int):
        perm = self.plan.permutation(epoch)
        for step in range(start_step, self.plan.steps_per_epoch):
            idx, aug = self.plan.rank_step(perm, epoch, step)
            images = self.images.index_select(0, idx)
            x = self.normalize(flat_gather_augment(images, *aug))
            m = self.plan.micro
            labels = self.labels.index_select(0, idx)
            yield step, [(x[i : i + m], labels[i : i + m]) for i in range(0, x.shape[0], m)]


def run(
    quick: bool = False,
    work: Path | None = None,
    rounds: int = 5,
    batch: int = 256,
    pil_images: int = 6144,
    workers: tuple[int, ...] = (0, 1, 2),
) -> Result | None:
    work = work or Path(tempfile.mkdtemp(prefix="bench-data-"))
    full = unpacked_cifar(work)
    if full is None:
        return None
    if quick:
        rounds, batch, pil_images, workers = 1, 64, 256, (0,)
        full = subset_folder(full, work / "subset-100", 100)
    cfg = config_mod.load(
        None, ["data.name=imagefolder", f"data.root={full}", "data.loader=tensor", f"data.cache_dir={work / 'cache'}"]
    )
    start = time.perf_counter()
    bundle = load_bundle(cfg.data)
    cache_seconds = time.perf_counter() - start
    plan = BatchPlan(len(bundle.train), batch, seed=0)
    loader = TrainLoader(
        bundle.train,
        plan,
        Normalizer(bundle.mean, bundle.std, torch.device("cpu"), True),
        torch.device("cpu"),
        True,
        0,
        32,
    )
    proposed = ProposedLoader(bundle.train, plan, loader.normalize, torch.device("cpu"), True, 0, 32)
    for (_, a), (_, b) in zip(loader.epoch(0, 0), proposed.epoch(0, 0), strict=False):  # the proposal must be exact
        if not (torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1], b[0][1])):
            raise AssertionError("proposed loader differs from TrainLoader")
        break
    project_images = min(len(bundle.train) // batch, max(8, 4 * pil_images // batch)) * batch
    epochs = itertools.count()

    def tensor_path(which: TrainLoader):
        def measure() -> float:
            n = 0
            start = time.perf_counter()
            for _, micro in itertools.islice(which.epoch(next(epochs), 0), project_images // batch):
                n += micro[0][0].shape[0]
            return n / (time.perf_counter() - start)

        return measure

    loaders = {w: pil_loader(full, batch, w, bundle.mean, bundle.std) for w in workers}

    def pil(w: int):
        def measure() -> float:
            n = 0
            start = time.perf_counter()
            for x, _ in itertools.islice(loaders[w], pil_images // batch):
                n += x.shape[0]
            return n / (time.perf_counter() - start)

        return measure

    sides = {"project": tensor_path(loader), "proposed": tensor_path(proposed), **{f"pil-{w}": pil(w) for w in workers}}
    rates = paired_rates(sides, rounds)
    best_w = max(workers, key=lambda w: median(rates[f"pil-{w}"]))
    ratio, per_round = median_ratio(rates["project"], rates[f"pil-{best_w}"])
    gain, _ = median_ratio(rates["proposed"], rates["project"])
    pil_summary = ", ".join(f"{w} workers {median(rates[f'pil-{w}']):,.0f} img/s" for w in workers)
    return Result(
        key="datapath",
        title="Data path (images/s, project TrainLoader ÷ ImageFolder + PIL DataLoader)",
        project=median(rates["project"]),
        baseline=median(rates[f"pil-{best_w}"]),
        unit="images/s",
        ratio=ratio,
        goal=15.0,
        higher_is_better=True,
        command=COMMAND,
        project_label="TrainLoader (uint8 cache, batched aug)",
        baseline_label=f"ImageFolder + PIL, {best_w} workers (best)",
        rounds=per_round,
        notes=f"batch {batch}, {len(bundle.train)} training images; PIL path: {pil_summary}; load_bundle (decode "
        f"cache, stats) {cache_seconds:.1f} s before timing; {torch.get_num_threads()} torch thread(s) in the "
        f"project loader; {rounds} interleaved rounds. Proposed fast path (index_select + one flat gather, "
        f"bit-identical): {median(rates['proposed']):,.0f} img/s, {gain:.2f}x the current TrainLoader",
        extra={
            "proposed_images_per_s": median(rates["proposed"]),
            "proposed_gain": gain,
            "pil": {str(w): median(rates[f"pil-{w}"]) for w in workers},
        },
    )
