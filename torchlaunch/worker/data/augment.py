"""Augmentation and normalisation of uint8 batches on the device (the in-memory path's crop + flip,
cutout) and the per-sample image transforms of the per-file path (RandomResizedCrop box, evaluation
resize + centre crop)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

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
        x = images.to(torch.float32, copy=True).mul_(self.scale).sub_(self.shift)  # no temporaries per batch
        return x.contiguous(memory_format=self.memory_format)


# ----------------------------------------------------------------------------------------------
# Per-sample boxes (the per-sample path: original-aspect images decoded in DataLoader workers)

RESIZED_SCALE = (0.08, 1.0)
RESIZED_RATIO = (3.0 / 4.0, 4.0 / 3.0)


def resized_crop_box(variates: Sequence[Sequence[float]], width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, w, h) of torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) on a
    width x height image, from the plan's uniform variates (one (scale, log-ratio, top, left) row per
    attempt): the same arithmetic as torchvision's get_params with its random draws replaced by these,
    so it is a pure function of (variates, width, height). An attempt whose box does not fit is
    skipped; after the last one, the centre crop with the ratio clamped."""
    area = width * height
    lo, hi = math.log(RESIZED_RATIO[0]), math.log(RESIZED_RATIO[1])
    for u_scale, u_ratio, u_top, u_left in variates:
        target = area * (RESIZED_SCALE[0] + (RESIZED_SCALE[1] - RESIZED_SCALE[0]) * float(u_scale))
        aspect = math.exp(lo + (hi - lo) * float(u_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = min(int(float(u_top) * (height - h + 1)), height - h)
            left = min(int(float(u_left) * (width - w + 1)), width - w)
            return left, top, w, h
    ratio = width / height
    if ratio < RESIZED_RATIO[0]:
        w, h = width, round(width / RESIZED_RATIO[0])
    elif ratio > RESIZED_RATIO[1]:
        w, h = round(height * RESIZED_RATIO[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def val_resize_for(image_size: int, val_resize: int, train_crop: str) -> int:
    """The evaluation's shorter-side resize: data.val_resize, else round(image_size / 0.875) (256 for
    224, the reference ImageNet evaluation) with the resized crop, else 0 (squash to the square)."""
    if val_resize:
        return val_resize
    return round(image_size / 0.875) if train_crop == "resized" else 0


def centre_box(width: int, height: int, image_size: int, resize: int) -> tuple[float, float, float, float]:
    """(left, top, w, h) in the original image of "resize the shorter side to `resize`, centre-crop
    image_size": the same region, so one resampling (box -> image_size) gives that view without the
    intermediate image."""
    side = image_size * min(width, height) / resize
    w, h = min(side, width), min(side, height)
    return (width - w) / 2, (height - h) / 2, w, h


def draft_request(width: int, height: int, box_w: float, box_h: float, image_size: int) -> tuple[int, int]:
    """The smallest whole-image size at which the box still holds image_size x image_size pixels: a
    JPEG then decodes at the largest DCT reduction (1/2, 1/4, 1/8) no smaller than this, which changes
    pixels only as much as downscaling before the resize does, never the box."""
    return math.ceil(width * image_size / box_w), math.ceil(height * image_size / box_h)


def crop_resize(
    im: Image.Image, width: int, height: int, box: tuple[float, float, float, float], image_size: int, flip: bool
) -> torch.Tensor:
    """The box (in the original width x height coordinates) of `im` (which may be a draft-scaled decode
    of that image) resized to image_size x image_size (bilinear with antialiasing), optionally
    mirrored, as uint8 (3, S, S). A whole-pixel box of a full-scale decode (every training box of an
    image decoded without draft) is cropped, then resized by torch (crop_resize_tensor); a fractional
    box (a draft-scaled decode, the evaluation's centre view) by PIL's resize over the box."""
    sx, sy = im.width / width, im.height / height
    left, top, w, h = box
    if sx == 1 and sy == 1 and all(float(v).is_integer() for v in box):
        return crop_resize_tensor(im, (int(left), int(top), int(w), int(h)), image_size, flip)
    out = im.resize(
        (image_size, image_size),
        Image.Resampling.BILINEAR,
        box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy),
    )
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(out, dtype=np.uint8).copy()).permute(2, 0, 1)


def crop_resize_tensor(im: Image.Image, box: tuple[int, int, int, int], image_size: int, flip: bool) -> torch.Tensor:
    """The whole-pixel box (left, top, w, h) of `im` resized to image_size x image_size, optionally
    mirrored, as uint8 (3, S, S): crop and mirror in PIL (a copy of the box only, never the whole
    image), then torch's antialiased bilinear resize of the uint8 channels-last crop. That is
    torchvision's RandomResizedCrop semantics (crop, then resize the crop alone) with its tensor
    kernel, ~3x faster per sample here than PIL's resize over a box (bench/loader224.py), and the same
    pixels for the same (box, flip) on any rank, worker count or world size (a pure per-sample
    function; the mirror is applied before the resize, as the box's pixels are what is mirrored)."""
    left, top, w, h = box
    region = im.crop((left, top, left + w, top + h))
    if flip:
        region = region.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return resize_hwc(torch.from_numpy(np.array(region, dtype=np.uint8)), image_size)


def crop_resize_hwc(pixels: torch.Tensor, box: tuple[int, int, int, int], image_size: int, flip: bool) -> torch.Tensor:
    """crop_resize_tensor for a decoded uint8 (H, W, 3) tensor instead of a PIL image (jpeg.decode_rgb):
    the box copied out (mirrored) into the same contiguous (h, w, 3) array crop_resize_tensor makes, so
    the resize runs the same kernel on the same bytes and the pixels are identical for the same decode."""
    left, top, w, h = box
    region = pixels[top : top + h, left : left + w]
    if flip:
        region = region.flip(1)
    return resize_hwc(region.contiguous(), image_size)


def resize_hwc(region: torch.Tensor, image_size: int) -> torch.Tensor:
    """A contiguous uint8 (h, w, 3) crop -> (3, S, S) by torch's antialiased bilinear resize of the
    channels-last view (no copy to planar first: the uint8 kernel works on interleaved channels)."""
    chw = region.permute(2, 0, 1)  # channels-last strides
    if tuple(chw.shape[1:]) == (image_size, image_size):
        return chw.contiguous()
    return torch.nn.functional.interpolate(
        chw[None], size=(image_size, image_size), mode="bilinear", antialias=True, align_corners=False
    )[0]
