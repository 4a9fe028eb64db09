"""One sample decoded under its crop box: the CPU decode both the per-sample loaders and the GPU-decode
path's CPU fallback use, so the two give the same pixels and box for the same draw."""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image

from torchlaunch.worker.data.augment import crop_resize, draft_request
from torchlaunch.worker.data.base import SampleReader
from torchlaunch.worker.folder_cache import DECODE_ERRORS, decode_error

BoxFn = Callable[[int, int], tuple[float, float, float, float]]


def load_box(
    source: list[str] | SampleReader, i: int, box_of: BoxFn, size: int, flip: bool
) -> tuple[torch.Tensor, tuple]:
    """Sample i cropped to box_of(width, height) and resized to size x size (optionally mirrored), with
    the box. The box is computed from the image's size BEFORE its pixels are decoded (header or index),
    so a JPEG can decode at the DCT scale the box allows (augment.draft_request)."""
    if isinstance(source, SampleReader):
        known = source.size(i)
        if known is None:
            im = source.open(i)
            width, height = im.size
            box = box_of(width, height)
        else:
            width, height = known
            box = box_of(width, height)
            im = source.open(i, draft_request(width, height, box[2], box[3], size))
        return crop_resize(im, width, height, box, size, flip), box
    path = source[i]
    try:
        with Image.open(path) as lazy:
            width, height = lazy.size
            box = box_of(width, height)
            if lazy.format == "JPEG":
                lazy.draft("RGB", draft_request(width, height, box[2], box[3], size))
            im = lazy.convert("RGB")
    except DECODE_ERRORS as e:
        raise decode_error(path, e) from None
    return crop_resize(im, width, height, box, size, flip), box
