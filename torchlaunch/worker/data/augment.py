"""Augmentation and normalisation of uint8 batches on the device (the in-memory path's crop + flip,
cutout) and the per-sample image transforms of the per-file path (RandomResizedCrop box, evaluation
resize + centre crop)."""

from __future__ import annotations

import torch

from torchlaunch.core.sampler import CROP_PADDING


def augment(
    images: torch.Tensor,
    dy: torch.Tensor,
    dx: torch.Tensor,
    flip: torch.Tensor,
    padding: int = CROP_PADDING,
    pad_mode: str = "zeros",
) -> torch.Tensor:
    """RandomCrop(size, padding, zero or reflect fill) + horizontal flip for a whole uint8 batch at
    once: one gather over the flattened padded images (4-5x faster than 4-D advanced indexing)."""
    n, c, h, w = images.shape
    p = padding
    mode = "constant" if pad_mode == "zeros" else pad_mode
    padded = torch.nn.functional.pad(images, (p, p, p, p), mode=mode).reshape(n, c, -1)
    device = images.device
    rows = dy.to(device)[:, None] + torch.arange(h, device=device)  # (n, h)
    cols = dx.to(device)[:, None] + torch.arange(w, device=device)  # (n, w)
    cols = torch.where(flip.to(device)[:, None], cols.flip(1), cols)
    flat = (rows[:, :, None] * (w + 2 * p) + cols[:, None, :]).reshape(n, 1, h * w).expand(n, c, h * w)
    return padded.gather(2, flat).reshape(n, c, h, w)


def cutout(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: int) -> torch.Tensor:
    """Zero a size x size square at (top, left) of every normalised image of batch x (N, C, H, W): zero is
    the channel mean there, so the blanked patch carries no colour of its own (airbench's cutout). Works in
    place on x (a fresh batch from the loader) and returns it."""
    n, _, h, w = x.shape
    device = x.device
    ys = torch.arange(h, device=device)[None, :] - top.to(device)[:, None]  # (n, h)
    xs = torch.arange(w, device=device)[None, :] - left.to(device)[:, None]  # (n, w)
    inside = ((ys >= 0) & (ys < size))[:, :, None] & ((xs >= 0) & (xs < size))[:, None, :]
    return x.masked_fill_(inside[:, None], 0.0)


class Normalizer:
    """uint8 -> float normalised by the dataset's mean/std, in the training memory format."""

    def __init__(
        self, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device, channels_last: bool
    ) -> None:
        self.scale = (1.0 / (255.0 * torch.tensor(std, device=device))).view(1, 3, 1, 1)
        self.shift = (torch.tensor(mean, device=device) / torch.tensor(std, device=device)).view(1, 3, 1, 1)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(torch.float32) * self.scale - self.shift
        return x.contiguous(memory_format=self.memory_format)
