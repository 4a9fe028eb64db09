"""One sample decoded under its crop box: the CPU decode both the per-sample loaders and the GPU-decode
path's CPU fallback use, so the two give the same pixels and box for the same draw."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from PIL import Image

from torchlaunch.data.folders import DECODE_ERRORS, decode_error
from torchlaunch.worker.data import jpeg
from torchlaunch.worker.data.augment import crop_resize, crop_resize_hwc, draft_request, resize_hwc
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
            proven = source.decodes_clean(i)
            prove = None if proven else functools.partial(source.record_clean, i)
            return decode_box(encoded[0], encoded[1], width, height, box, size, flip, proven, prove), box
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
                out = tensor_crop(lazy.fp.read(), width, height, box, size, flip)
                if out is not None:
                    return out, box
            im = lazy.convert("RGB")
    except DECODE_ERRORS as e:
        raise decode_error(path, e) from None
    return crop_resize(im, width, height, box, size, flip), box


def tensor_decodable(lazy: Image.Image, width: int, height: int, box: tuple[float, float, float, float]) -> bool:
    """Whether the tensor decoders (jpeg.decode_window, jpeg.decode_rgb) give the pixels PIL would for
    this opened (not yet decoded) image: a JPEG PIL reads as RGB or grey (libjpeg-turbo converts both
    to RGB as PIL's convert does; CMYK conversions differ), at full scale (the draft the box allows did
    not reduce it: the tensor path does no DCT scaling), of the expected size, under a whole-pixel box
    (the training crop's; the evaluation's fractional centre box resamples through PIL)."""
    return (
        jpeg.available()
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


def tensor_crop(
    data: bytes,
    width: int,
    height: int,
    box: tuple[float, float, float, float],
    size: int,
    flip: bool,
    proven: bool = False,
    prove: Callable[[], None] | None = None,
) -> torch.Tensor | None:
    """The whole-pixel `box` of the width x height JPEG `data` resized to size x size (mirrored when
    `flip`) through a tensor decode: the window decoder (only the box decoded), else the whole image
    decoded and the box cropped, the same bytes either way (jpeg.decode_window); None when neither
    decodes it, and the caller's PIL path decodes it or names the error.

    `proven`: these bytes already decoded whole without an error or a warning in this run (a member's
    proof, SampleReader.decodes_clean), so the window decode stops after the box. Otherwise it reads the
    stream to its end, refusing what a whole decode refuses, and a success calls `prove` (the member's
    proof recorded for its next draws)."""
    crop = whole(box)
    region = jpeg.decode_window(data, width, height, crop, flip, to_end=not proven)
    if region is not None:
        if prove is not None and not proven:
            prove()
        return resize_hwc(region, size)
    pixels = jpeg.decode_rgb(data)
    if pixels is not None and tuple(pixels.shape[:2]) == (height, width):
        return crop_resize_hwc(pixels, crop, size, flip)
    return None


def decode_box(
    data: bytes,
    where: str,
    width: int,
    height: int,
    box: tuple[float, float, float, float],
    size: int,
    flip: bool,
    proven: bool = False,
    prove: Callable[[], None] | None = None,
) -> torch.Tensor:
    """A stored member (a shard's bytes, its index size width x height) under `box`, resized to size x
    size, the same pixels for the same (member, box, flip) on every path: a plain JPEG header
    (jpeg.plain_size) at full scale skips PIL altogether; other JPEGs PIL reads as RGB or grey are
    opened by PIL and decoded to a tensor (tensor_decodable); everything else, and whatever the tensor
    decoder refuses, is decoded by PIL with the box's draft, as shards.decode does, with its ShardError
    naming `where` for bad data. `proven` and `prove`: a member's clean-decode proof (tensor_crop); the
    pixels do not depend on them."""
    from torchlaunch.data.shards.decode import decode, finish, open_lazy

    request = draft_request(width, height, box[2], box[3], size)
    if whole_pixels(box) and not drafted(width, height, request) and jpeg.plain_size(data) == (width, height):
        out = tensor_crop(data, width, height, box, size, flip, proven, prove)
        if out is not None:
            return out
        return crop_resize(decode(data, where, request), width, height, box, size, flip)  # PIL names the error
    lazy = open_lazy(data, where, request)
    if tensor_decodable(lazy, width, height, box):
        out = tensor_crop(data, width, height, box, size, flip, proven, prove)
        if out is not None:
            return out
    return crop_resize(finish(lazy, where), width, height, box, size, flip)


def drafted(width: int, height: int, request: tuple[int, int]) -> bool:
    """Whether PIL's JPEG draft to `request` decodes at a reduced DCT scale (JpegImageFile.draft: the
    largest of 8, 4, 2 not above min(width // request width, height // request height))."""
    return min(width // max(1, int(request[0])), height // max(1, int(request[1]))) >= 2
