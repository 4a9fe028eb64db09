"""Loaders: the training loader that yields this rank's micro-batches of every step of the batch plan
(in-memory gather or per-sample DataLoader workers), and the evaluation batches."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from torchlaunch.core.sampler import BatchPlan
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data.augment import Normalizer, augment, cutout
from torchlaunch.worker.data.base import ImageSet, SampleReader, decode_image


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


def _reraise_bad_input(e: Exception) -> None:
    """DataLoader workers wrap exceptions in a traceback text; recover our one-line message."""
    for line in str(e).splitlines():
        line = line.split("BadInput: ", 1)[-1]
        if line.startswith(("data error:", "config error:")):
            raise BadInput(line) from None


class TrainLoader:
    """Yields this rank's micro-batches for each step of an epoch, from any starting step."""

    def __init__(
        self,
        data: ImageSet,
        plan: BatchPlan,
        normalize: Normalizer,
        device: torch.device,
        augment_on: bool,
        num_workers: int,
        image_size: int,
    ) -> None:
        self.data, self.plan, self.normalize, self.device = data, plan, normalize, device
        self.augment_on, self.num_workers, self.image_size = augment_on, num_workers, image_size
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

    def _file_epoch(self, perm: torch.Tensor, epoch: int, steps: range) -> Iterator:
        batches = [self.plan.rank_step(perm, epoch, s)[0].tolist() for s in steps]
        loader = torch.utils.data.DataLoader(
            _FileDataset(self.data.files, self.data.labels, self.image_size),
            batch_sampler=batches,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
            multiprocessing_context="fork" if self.num_workers else None,
        )
        try:
            for step, (images, labels) in zip(steps, loader, strict=True):
                _, aug = self.plan.rank_step(perm, epoch, step)
                yield (
                    step,
                    self._micro_batches(
                        images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True), aug
                    ),
                )
        except Exception as e:  # noqa: BLE001 - only to recover a worker's BadInput message
            _reraise_bad_input(e)
            raise

    def _micro_batches(
        self, images: torch.Tensor, labels: torch.Tensor, aug: tuple[torch.Tensor, ...]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dy, dx, flip, *box = aug
        if self.augment_on:
            images = augment(images, dy, dx, flip, padding=self.plan.crop_padding, pad_mode=self.plan.pad_mode)
        x = self.normalize(images)
        if self.augment_on and box:
            x = cutout(x, box[0], box[1], self.plan.cutout)
        m = self.plan.micro
        return [(x[i : i + m], labels[i : i + m]) for i in range(0, x.shape[0], m)]


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
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    shard = eval_shard(len(data), rank, world_size)
    if data.images is not None:
        for start in range(shard.start, shard.stop, batch):
            stop = min(start + batch, shard.stop)
            yield normalize(data.images[start:stop].to(device)), data.labels[start:stop].to(device)
        return
    index_batches = [list(range(s, min(s + batch, shard.stop))) for s in range(shard.start, shard.stop, batch)]
    loader = torch.utils.data.DataLoader(
        _FileDataset(data.files, data.labels, image_size), batch_sampler=index_batches, num_workers=num_workers
    )
    try:
        for images, labels in loader:
            yield normalize(images.to(device)), labels.to(device)
    except Exception as e:  # noqa: BLE001
        _reraise_bad_input(e)
        raise
