"""One sample decoded under its crop box: the CPU decode both the per-sample loaders and the GPU-decode
path's CPU fallback use, so the two give the same pixels and box for the same draw."""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image

from torchlaunch.data.folders import DECODE_ERRORS, decode_error
from torchlaunch.worker.data import jpeg
from torchlaunch.worker.data.augment import crop_resize, crop_resize_hwc, draft_request
from torchlaunch.worker.data.base import SampleReader

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
            return crop_resize(im, width, height, box, size, flip), box
        width, height = known
        box = box_of(width, height)
        encoded = source.encoded(i)
        if encoded is not None:
            return decode_box(encoded[0], encoded[1], width, height, box, size, flip), box
        im = source.open(i, draft_request(width, height, box[2], box[3], size))
        return crop_resize(im, width, height, box, size, flip), box
    path = source[i]
    try:
        with Image.open(path) as lazy:
            width, height = lazy.size
            box = box_of(width, height)
            if lazy.format == "JPEG":
                lazy.draft("RGB", draft_request(width, height, box[2], box[3], size))
            if tensor_decodable(lazy, width, height, box):
                lazy.fp.seek(0)
                pixels = jpeg.decode_rgb(lazy.fp.read())
                if pixels is not None and tuple(pixels.shape[:2]) == (height, width):
                    return crop_resize_hwc(pixels, whole(box), size, flip), box
            im = lazy.convert("RGB")
    except DECODE_ERRORS as e:
        raise decode_error(path, e) from None
    return crop_resize(im, width, height, box, size, flip), box


def tensor_decodable(lazy: Image.Image, width: int, height: int, box: tuple[float, float, float, float]) -> bool:
    """Whether jpeg.decode_rgb gives the pixels PIL would for this opened (not yet decoded) image: a
    JPEG PIL reads as RGB or grey (libjpeg-turbo converts both to RGB as PIL's convert does; CMYK
    conversions differ), at full scale (the draft the box allows did not reduce it: torchvision has no
    DCT scaling), of the expected size, under a whole-pixel box (the training crop's; the evaluation's
    fractional centre box resamples through PIL)."""
    return (
        jpeg.decoder() is not None
        and lazy.format == "JPEG"
        and lazy.mode in ("RGB", "L")
        and lazy.size == (width, height)
        and whole_pixels(box)
    )


def whole_pixels(box: tuple[float, float, float, float]) -> bool:
    return all(float(v).is_integer() for v in box)


def whole(box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    left, top, w, h = box
    return int(left), int(top), int(w), int(h)


def decode_box(
    data: bytes, where: str, width: int, height: int, box: tuple[float, float, float, float], size: int, flip: bool
) -> torch.Tensor:
    """A stored member (a shard's bytes, its index size width x height) under `box`, resized to size x
    size, the same pixels for the same (member, box, flip) on every path: a plain JPEG header
    (jpeg.plain_size) at full scale skips PIL altogether; other JPEGs PIL reads as RGB or grey are
    opened by PIL and decoded to a tensor (tensor_decodable); everything else, and whatever the tensor
    decoder refuses, is decoded by PIL with the box's draft, as shards.decode does, with its ShardError
    naming `where` for bad data."""
    from torchlaunch.data.shards.decode import decode, finish, open_lazy

    request = draft_request(width, height, box[2], box[3], size)
    if whole_pixels(box) and not drafted(width, height, request) and jpeg.plain_size(data) == (width, height):
        pixels = jpeg.decode_rgb(data)
        if pixels is not None and tuple(pixels.shape[:2]) == (height, width):
            return crop_resize_hwc(pixels, whole(box), size, flip)
        return crop_resize(decode(data, where, request), width, height, box, size, flip)  # PIL names the error
    lazy = open_lazy(data, where, request)
    if tensor_decodable(lazy, width, height, box):
        pixels = jpeg.decode_rgb(data)
        if pixels is not None and tuple(pixels.shape[:2]) == (height, width):
            return crop_resize_hwc(pixels, whole(box), size, flip)
    return crop_resize(finish(lazy, where), width, height, box, size, flip)


def drafted(width: int, height: int, request: tuple[int, int]) -> bool:
    """Whether PIL's JPEG draft to `request` decodes at a reduced DCT scale (JpegImageFile.draft: the
    largest of 8, 4, 2 not above min(width // request width, height // request height))."""
    return min(width // max(1, int(request[0])), height // max(1, int(request[1]))) >= 2
