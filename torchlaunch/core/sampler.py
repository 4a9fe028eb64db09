"""The global-step batch plan: which samples, and which augmentation draws, every rank gets at every
(epoch, step).

Determinism contract (what makes exact resume and world-size changes possible):
- the global order of an epoch is a permutation that depends only on (seed, epoch);
- global step s of an epoch is the slice perm[s*B:(s+1)*B] of that order (B = global batch);
- rank r of W takes the r-th of W contiguous parts of that slice (shares differ by at most one sample:
  the first B mod W ranks take one more), split into the same number of micro-steps on every rank;
- augmentation parameters (crop offsets or RandomResizedCrop variates, flips, cutout squares) are drawn
  per global step from (seed, epoch, step) and sliced the same way.
So the samples and augmentations in a global step do not depend on the world size at all, and
resuming needs only (epoch, step within the epoch): no data is replayed. Any world size from 1 to B
runs the same global step: with uneven shares each micro-batch's mean loss is weighted by
count * W / B (loss_weight), so DDP's average over W ranks is the mean over the global batch.

It lives in core (not in the worker's data package) because the public API (torchlaunch.api's
resumable sampler) shares it without importing readers, decoders or PIL.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from fractions import Fraction

import torch

from torchlaunch.exit_codes import ConfigError

CROP_PADDING = 4
RESIZED_ATTEMPTS = 10
"""RandomResizedCrop's tries at a box inside the image before its centre-crop fallback (torchvision's)."""


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, identical in every process (unlike hash())."""
    digest = hashlib.blake2b(b",".join(str(int(p)).encode() for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class BatchPlan:
    """Which samples and augmentations each rank gets at every (epoch, step)."""

    num_samples: int
    global_batch: int
    seed: int
    rank: int = 0
    world_size: int = 1
    micro_batch: int = 0
    crop_padding: int = CROP_PADDING
    flip: str = "random"
    """`random`, `alternate` or `none` (see DataConfig.flip)."""
    pad_mode: str = "zeros"
    """`zeros` or `reflect`: how the random crop's border is filled."""
    cutout: int = 0
    """Side of the square blanked in every training image after crop and flip (0 = off)."""
    image_size: int = 32
    """Side of the training images: bounds where a cutout square may sit."""
    train_crop: str = "pad"
    """`pad` (the crop offsets dy, dx) or `resized` (RandomResizedCrop variates: see resized_variates)."""
    grid: int = 0
    """Micro-batches per global step in the exact grid (worker/grid.py), 0 = off. On: micro-batch i of a
    step is samples i*B/G:(i+1)*B/G of it whatever the world size, and rank r takes the r-th of W
    contiguous runs of micro-batches (counts differ by at most one), each of B/G samples."""
    counts: tuple[int, ...] = ()
    """With the grid: how many micro-batches each rank computes, in rank order (a straggler given fewer:
    worker/balance.py); empty = the even split. Any spread gives the same bits (worker/grid.py)."""

    def __post_init__(self) -> None:
        if self.global_batch < self.world_size:
            raise ConfigError(
                "train.batch_size",
                f"{self.global_batch} is smaller than the world size {self.world_size}: "
                f"{self.world_size - self.global_batch} rank(s) would get no samples",
                f"use a global batch of at least {self.world_size}, or at most {self.global_batch} ranks",
            )
        if self.micro_batch < 0:
            raise ConfigError("train.micro_batch_size", f"must be >= 0, got {self.micro_batch}", "use 0 for no limit")
        if self.cutout > self.image_size:
            raise ConfigError(
                "data.cutout",
                f"{self.cutout} is larger than the {self.image_size}-pixel images",
                f"use a square of at most {self.image_size}, e.g. data.cutout=12, or 0 for off",
            )
        if self.grid and (self.global_batch % self.grid or self.world_size > self.grid):
            raise ConfigError(
                "train.grid_micro_batches",
                f"{self.grid} micro-batches do not cut a global batch of {self.global_batch} over {self.world_size} rank(s)",
                "use a divisor of train.batch_size at least the largest world size, or 0 for auto",
            )
        if self.counts and (
            len(self.counts) != self.world_size or sum(self.counts) != self.grid or min(self.counts) < 1
        ):
            raise ValueError(
                f"grid counts {self.counts} do not cut {self.grid} micro-batches over {self.world_size} ranks"
            )
        if self.steps_per_epoch < 1:
            raise ConfigError(
                "train.batch_size",
                f"{self.global_batch} is larger than the training set of {self.num_samples} samples",
                "use a smaller batch",
            )

    @property
    def shares(self) -> tuple[int, ...]:
        """Every rank's samples per global step: B split into W contiguous parts that differ by at most
        one (the first B mod W ranks take one more); with the grid, whole micro-batches of B/G."""
        if self.grid:
            return tuple(len(self.grid_range(r)) * (self.global_batch // self.grid) for r in range(self.world_size))
        base, extra = divmod(self.global_batch, self.world_size)
        return tuple(base + (r < extra) for r in range(self.world_size))

    @property
    def per_rank(self) -> int:
        """This rank's share of every global step (see shares)."""
        if self.grid:
            return self.shares[self.rank]
        base, extra = divmod(self.global_batch, self.world_size)
        return base + (self.rank < extra)

    def grid_range(self, rank: int | None = None) -> range:
        """The grid's micro-batch ids a rank computes at every step: `counts` when set, else the even split
        (the first G mod W ranks take one more)."""
        r = self.rank if rank is None else rank
        if self.counts:
            start = sum(self.counts[:r])
            return range(start, start + self.counts[r])
        base, extra = divmod(self.grid, self.world_size)
        start = r * base + min(r, extra)
        return range(start, start + base + (r < extra))

    @property
    def accumulation(self) -> int:
        """Micro-steps per global step, the same on every rank (DDP syncs on the last one): enough for
        the largest share to fit train.micro_batch_size. With the grid: the most micro-batches of a rank."""
        if self.grid:
            return max(self.counts) if self.counts else -(-self.grid // self.world_size)
        return -(-self._largest_share // self.micro_batch) if self.micro_batch else 1

    @property
    def micro(self) -> int:
        """The largest micro-batch of any rank (at most micro_batch when that is set)."""
        if self.grid:
            return self.global_batch // self.grid
        return -(-self._largest_share // self.accumulation)

    @property
    def _largest_share(self) -> int:
        return -(-self.global_batch // self.world_size)

    def micro_sizes(self) -> list[int]:
        """This rank's micro-batch sizes, smallest first: its share split into `accumulation` parts that
        differ by at most one, so at every micro-step the ranks' batches differ by at most one sample.
        A part is 0 only with train.micro_batch_size=1 on uneven shares; never the last one. With the
        grid: B/G each, as many as the rank's micro-batches."""
        if self.grid:
            return [self.micro] * len(self.grid_range())
        base, extra = divmod(self.per_rank, self.accumulation)
        return [base] * (self.accumulation - extra) + [base + 1] * extra

    def loss_weight(self, count: int) -> Fraction:
        """What a micro-batch's MEAN loss over `count` samples is multiplied by: count * W / B. DDP
        averages the ranks' gradients (divides by W), so the step's gradient is the mean over the
        global batch, whatever the shares; with even shares and k micro-steps it is exactly 1/k."""
        return Fraction(count * self.world_size, self.global_batch)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch  # the last partial batch is dropped

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch, 1))
        return torch.randperm(self.num_samples, generator=g)

    def global_augmentation(
        self, epoch: int, step: int, indices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """(dy, dx, flip) for every sample of the global step, plus (cutout_y, cutout_x) corners when
        `cutout` is on; `indices` (the step's global sample indices) are needed by the `alternate` flip,
        which is a function of (sample, epoch). The cutout corners are drawn last from the same
        generator, so turning cutout on leaves every crop and flip of a run unchanged. With
        train_crop=resized the first element is the (B, RESIZED_ATTEMPTS, 4) RandomResizedCrop variates
        instead of (dy, dx): (variates, flip[, cutout_y, cutout_x]); the flips are the same draws."""
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch, step, 2))
        shifts = torch.randint(0, 2 * self.crop_padding + 1, (2, self.global_batch), generator=g)
        flips = torch.randint(0, 2, (self.global_batch,), generator=g).bool()
        if self.flip == "none":
            flips = torch.zeros_like(flips)
        elif self.flip == "alternate":
            if indices is None:
                raise ValueError("the alternate flip needs the step's sample indices")
            flips = self.first_epoch_flips()[indices] ^ bool(epoch % 2)
        crop: tuple[torch.Tensor, ...] = (shifts[0], shifts[1])
        if self.train_crop == "resized":
            crop = (self.resized_variates(epoch, step),)
        if self.cutout <= 0:
            return (*crop, flips)
        corners = torch.randint(0, self.image_size - self.cutout + 1, (2, self.global_batch), generator=g)
        return (*crop, flips, corners[0], corners[1])

    def resized_variates(self, epoch: int, step: int) -> torch.Tensor:
        """Uniform [0, 1) float64 variates (B, RESIZED_ATTEMPTS, 4) of the step's RandomResizedCrops:
        per attempt (scale, log-ratio, top, left). They do not depend on any image's size; the box is a
        pure function of them and the image's (width, height) (worker.data.augment.resized_crop_box), so
        a sample gets the same box at the same global step on any world size and number of workers."""
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch, step, 4))
        return torch.rand(self.global_batch, RESIZED_ATTEMPTS, 4, generator=g, dtype=torch.float64)

    def first_epoch_flips(self) -> torch.Tensor:
        """The `alternate` flip's per-sample coin, fixed by the seed; epoch e flips it e times."""
        g = torch.Generator().manual_seed(mix_seed(self.seed, 3))
        return torch.randint(0, 2, (self.num_samples,), generator=g).bool()

    def rank_slice(self) -> slice:
        """This rank's contiguous part of a global step's B samples (and of its augmentation draws)."""
        if self.grid:
            ids = self.grid_range()
            return slice(ids.start * self.micro, ids.stop * self.micro)
        base, extra = divmod(self.global_batch, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + self.per_rank)

    def shares_text(self) -> str:
        """The shares as a person reads them: `2 x 24`, `22/21/21`, or `8 x 3 + 24 x 2` for many ranks."""
        base, extra = divmod(self.global_batch, self.world_size)
        if not extra:
            return f"{self.world_size} x {base}"
        if self.world_size <= 8:
            return "/".join(map(str, self.shares))
        return f"{extra} x {base + 1} + {self.world_size - extra} x {base}"

    def step_indices(self, perm: torch.Tensor, step: int) -> torch.Tensor:
        """Every rank's samples of global step `step`: slice step*B:(step+1)*B of the epoch's permutation."""
        return perm[step * self.global_batch : (step + 1) * self.global_batch]

    def rank_step(self, perm: torch.Tensor, epoch: int, step: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """This rank's sample indices and augmentation parameters at (epoch, step)."""
        sl = self.rank_slice()
        step_indices = self.step_indices(perm, step)
        aug = tuple(t[sl] for t in self.global_augmentation(epoch, step, step_indices))
        return step_indices[sl], aug
