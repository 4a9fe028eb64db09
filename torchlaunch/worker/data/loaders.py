"""Loaders: the training loader that yields this rank's micro-batches of every step of the batch plan
(in-memory gather or per-sample DataLoader workers), and the evaluation batches."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from torchlaunch.config import ConfigError
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.exit_codes import BadInput, unwrapped
from torchlaunch.worker.data import gpu_decode, jpeg
from torchlaunch.worker.data.augment import (
    Normalizer,
    augment,
    centre_box,
    cutout,
    resized_crop_box,
)
from torchlaunch.worker.data.base import ImageSet, SampleReader, decode_image
from torchlaunch.worker.data.boxes import load_box


class _FileDataset(torch.utils.data.Dataset):
    """Decodes one file per index: the per-sample path for images of any size."""

    def __init__(self, files: list[str] | SampleReader, labels: torch.Tensor, size: int) -> None:
        self.files, self.labels, self.size = files, labels, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if isinstance(self.files, SampleReader):
            return self.files.image(i, self.size), int(self.labels[i])
        return decode_image(self.files[i], self.size), int(self.labels[i])


class _BoxDataset(torch.utils.data.Dataset):
    """The per-sample path without squashing: item (i, variates, flip) is sample i under the
    RandomResizedCrop box of those variates (training), item (i, None, False) the evaluation's
    resize-shorter-side + centre crop (`resize`). Returns (uint8 image, label, box (left, top, w, h))."""

    def __init__(self, files: list[str] | SampleReader, labels: torch.Tensor, size: int, resize: int) -> None:
        self.files, self.labels, self.size, self.resize = files, labels, size, resize

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, item: tuple[int, Any, bool]) -> tuple[torch.Tensor, int, torch.Tensor]:
        i, variates, flip = item
        if variates is None:

            def box_of(w: int, h: int) -> tuple[float, float, float, float]:
                return centre_box(w, h, self.size, self.resize)
        else:

            def box_of(w: int, h: int) -> tuple[float, float, float, float]:
                return resized_crop_box(variates, w, h)

        image, box = load_box(self.files, i, box_of, self.size, flip)
        return image, int(self.labels[i]), torch.tensor(box, dtype=torch.float64)


def _reraise_bad_input(e: Exception) -> None:
    """DataLoader workers wrap exceptions in a traceback text (torch raises X(that text) again, or a
    RuntimeError when X takes other arguments, as ConfigError does); recover our one-line message, the
    worker's error's own (exit_codes.unwrapped)."""
    line = unwrapped(str(e))
    if line.startswith(("data error:", "config error:")):
        raise BadInput(line) from None


TORCH_WORKER_WARNING = r"This DataLoader will create \d+ worker processes in total"
"""torch's DataLoader warning when data.num_workers exceeds the cores a rank may use: six lines, from
every rank, each launch. TrainLoader silences it; rank 0 says worker_count_note once instead."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a pinned CPU rank's slice), as torch counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


DEFAULT_WORKERS = 2
"""data.num_workers' default (torchlaunch/data/section.py): the count the project ships, tests and measures."""


def worker_count_note(num_workers: int, cores: int) -> str | None:
    """The one line for more DataLoader processes per rank than it has cores, set above the default, or
    None. Why not for the default (issue 51 item 10: it drew the project's own note on every 2-core launch,
    where each CPU rank is pinned to one core): forked workers inherit that core and take turns on it with
    the rank, decoding the next batches while it trains. Measured there (smoke recipe on shards, resized
    crops, 2 ranks, load 5-7): 2 workers 518-1,760 images/s, 1 worker 391-1,510, no difference in the noise."""
    if num_workers <= cores or num_workers <= DEFAULT_WORKERS:
        return None
    return (
        f"note: data.num_workers={num_workers} loader processes per rank share the {cores} core(s) this rank "
        f"may use (data.num_workers={cores} avoids the contention; 0 loads in the training process)"
    )


class TrainLoader:
    """Yields this rank's micro-batches for each step of an epoch, from any starting step.

    With `trace` on, `step_trace` holds the augmentation each yielded step's samples got (pad: dy, dx,
    flip; resized: the resolved box (left, top, w, h) and flip), for debug.trace_batches."""

    def __init__(
        self,
        data: ImageSet,
        plan: BatchPlan,
        normalize: Normalizer,
        device: torch.device,
        augment_on: bool,
        num_workers: int,
        image_size: int,
        trace: bool = False,
        val_resize: int = 0,
        decode: str = "cpu",
    ) -> None:
        self.data, self.plan, self.normalize, self.device = data, plan, normalize, device
        self.augment_on, self.num_workers, self.image_size = augment_on, num_workers, image_size
        self.trace, self.val_resize, self.decode = trace, val_resize, decode
        if decode == "gpu":  # data.decode=gpu (worker/data/gpu_decode.py): a CUDA device or one line, exit 2
            gpu_decode.check_device(device)
        self.step_trace: dict[str, list] = {}
        self.worker_note: str | None = None
        """For rank 0 to print once (TORCH_WORKER_WARNING)."""
        if data.images is None and num_workers:
            warnings.filterwarnings("ignore", message=TORCH_WORKER_WARNING, category=UserWarning)
            self.worker_note = worker_count_note(num_workers, usable_cores())
        self.resized = plan.train_crop == "resized"
        if self.resized and data.images is not None:
            raise ConfigError(
                "data.train_crop",
                "resized crops the original-aspect images of the per-sample path, and this training set is "
                "decoded into memory at one size",
                "use data.train_crop=pad, or data.name=shards, or data.name=imagefolder with data.loader=pil",
            )
        self.images = data.images
        if self.images is not None and device.type == "cuda":
            self.images = self.images.to(device)  # the whole uint8 set fits easily on a GPU
            self.labels = data.labels.to(device)
        else:
            self.labels = data.labels

    def epoch(self, epoch: int, start_step: int) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        perm = self.plan.permutation(epoch)
        steps = range(start_step, self.plan.steps_per_epoch)
        if self.images is not None:
            for step in steps:
                idx, aug = self.plan.rank_step(perm, epoch, step)
                if self.trace:
                    self.step_trace = {"dy": aug[0].tolist(), "dx": aug[1].tolist(), "flip": aug[2].tolist()}
                idx, *aug = (self._to_device(t) for t in (idx, *aug))
                yield step, self._micro_batches(self.images.index_select(0, idx), self.labels.index_select(0, idx), aug)
            return
        yield from self._file_epoch(perm, epoch, steps)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """The step's indices and augmentation draws on the images' device. To CUDA through pinned
        memory, without blocking: a plain copy from pageable memory waits for the queued steps."""
        if self.images is None or self.images.device.type != "cuda":
            return t
        return t.pin_memory().to(self.images.device, non_blocking=True)

    def _items(self, perm: torch.Tensor, epoch: int, step: int) -> list:
        """The DataLoader's items of one step: sample indices, or with the resized crop (index, the
        sample's crop variates, flip) so workers resolve the box where the image is decoded."""
        idx, aug = self.plan.rank_step(perm, epoch, step)
        if not self.resized:
            return idx.tolist()
        if not self.augment_on:
            return [(i, None, False) for i in idx.tolist()]
        variates, flips = aug[0].numpy(), aug[1].tolist()
        return [(i, variates[k], flips[k]) for k, i in enumerate(idx.tolist())]

    def _file_epoch(self, perm: torch.Tensor, epoch: int, steps: range) -> Iterator:
        batches = [self._items(perm, epoch, s) for s in steps]
        if self.resized:
            resize = self.val_resize or round(self.image_size / 0.875)  # augment off: the evaluation view
            dataset: torch.utils.data.Dataset = _BoxDataset(self.data.files, self.data.labels, self.image_size, resize)
        else:
            dataset = _FileDataset(self.data.files, self.data.labels, self.image_size)
        gpu = self.resized and self.decode == "gpu"
        if self.resized and self.num_workers and not gpu:
            jpeg.window_decoder()  # its once-per-process check made here, inherited by every epoch's forked workers
        if gpu:  # workers hand on encoded bytes + the same boxes and flips; decoded on the device below
            dataset = gpu_decode.EncodedDataset(self.data.files, self.data.labels, self.image_size, resize)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            collate_fn=gpu_decode.collate if gpu else None,
            pin_memory=self.device.type == "cuda" and not gpu,
            multiprocessing_context="fork" if self.num_workers else None,
        )
        try:
            for step, batch in zip(steps, loader, strict=True):
                if gpu:
                    batch = gpu_decode.to_batch(batch, self.image_size, self.device)
                _, aug = self.plan.rank_step(perm, epoch, step)
                images, labels = batch[0], batch[1]
                if self.trace:
                    self.step_trace = self._trace(batch, aug)
                yield (
                    step,
                    self._micro_batches(
                        images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True), aug
                    ),
                )
        except Exception as e:  # noqa: BLE001 - only to recover a worker's BadInput message
            _reraise_bad_input(e)
            raise

    def _trace(self, batch: list, aug: tuple[torch.Tensor, ...]) -> dict[str, list]:
        if not self.resized:
            return {"dy": aug[0].tolist(), "dx": aug[1].tolist(), "flip": aug[2].tolist()}
        flips = aug[1].tolist() if self.augment_on else [False] * len(batch[2])
        return {"box": [[round(v, 3) for v in b] for b in batch[2].tolist()], "flip": flips}

    def _micro_batches(
        self, images: torch.Tensor, labels: torch.Tensor, aug: tuple[torch.Tensor, ...]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.resized:  # cropped, resized and flipped in the workers already
            box = list(aug[2:])
        else:
            dy, dx, flip, *box = aug
            if self.augment_on:
                images = augment(images, dy, dx, flip, padding=self.plan.crop_padding, pad_mode=self.plan.pad_mode)
        x = self.normalize(images)
        if self.augment_on and box:
            x = cutout(x, box[0], box[1], self.plan.cutout)
        sizes = self.plan.micro_sizes()  # this rank's share in the plan's micro-steps (uneven shares too)
        return list(zip(x.split(sizes), labels.split(sizes), strict=True))


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """Contiguous, non-overlapping shard: every sample is evaluated exactly once across ranks."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def eval_batches(
    data: ImageSet,
    rank: int,
    world_size: int,
    batch: int,
    normalize: Normalizer,
    device: torch.device,
    image_size: int,
    num_workers: int = 0,
    val_resize: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's evaluation shard in batches. The per-sample path squashes each image to the square,
    or with `val_resize` > 0 resizes its shorter side to that and centre-crops image_size."""
    shard = eval_shard(len(data), rank, world_size)
    if data.images is not None:
        for start in range(shard.start, shard.stop, batch):
            stop = min(start + batch, shard.stop)
            yield normalize(data.images[start:stop].to(device)), data.labels[start:stop].to(device)
        return
    index_batches = [list(range(s, min(s + batch, shard.stop))) for s in range(shard.start, shard.stop, batch)]
    dataset: torch.utils.data.Dataset = _FileDataset(data.files, data.labels, image_size)
    if val_resize > 0:
        dataset = _BoxDataset(data.files, data.labels, image_size, val_resize)
        index_batches = [[(i, None, False) for i in b] for b in index_batches]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=index_batches, num_workers=num_workers)
    try:
        for batch in loader:
            yield normalize(batch[0].to(device)), batch[1].to(device)
    except Exception as e:  # noqa: BLE001
        _reraise_bad_input(e)
        raise
