"""The CPU decoder of shard members: encoded bytes -> an RGB PIL image.

PIL is the default decoder, by measurement (bench/shards.py, docs/BENCHMARKS.md, one thread, decode +
RandomResizedCrop to 224): at ImageNet-like 500x375 PIL, PIL with draft and simplejpeg were within the
box's noise of each other and torchvision.io.decode_jpeg + a tensor crop ~1.2x faster; on 32x32 CIFAR
JPEGs simplejpeg ~1.2x. No CPU candidate was worth a new dependency or a torch import here: this
function returns the PIL image the CPU augmentation works on, stays torch-free (the pre-check and
`verify` use it), and handles every mode a real set holds (ImageNet has CMYK and grayscale JPEGs and a
PNG named .JPEG). The training crop of a shard member reads the header here (`open_lazy`) and lets
torchvision's libjpeg-turbo decode the pixels straight to a tensor when they are PIL's to the byte
(torchlaunch/worker/data/jpeg.py); everything else goes through `finish`. Draft mode (libjpeg's DCT scaling) pays
only when the image is at least twice the size it is resized to (large originals, small crops
rarely reach that at 500x375); it costs nothing otherwise. Every mode ends as 8-bit RGB here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from io import BytesIO

import numpy as np
from PIL import Image

from torchlaunch.data.shards.errors import ShardError

FIX = "replace that image: rewrite the shard with python -m train.shards write, or remove the sample"


def to_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB from any PIL mode: 16-bit and float grey scaled to 0-255, alpha dropped, palette,
    CMYK and YCbCr converted."""
    if im.mode == "RGB":
        return im
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") else max(float(a.max()), 1.0)
        if im.mode == "I" and a.max() <= 255:
            top = 255.0
        a = np.clip(a * (255.0 / top), 0, 255).round().astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    return im.convert("RGB")


@contextmanager
def named(where: str) -> Iterator[None]:
    """PIL's errors on a member as the one-line ShardError naming `where`: a decompression bomb (refused
    by Image.open, before any pixel is decoded) and any undecodable data."""
    try:
        yield
    except Image.DecompressionBombError as e:
        raise ShardError(f"{where} is too large to decode ({str(e).split(' could be')[0]})", FIX) from None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error... for bad data
        raise ShardError(f"{where} cannot be decoded ({type(e).__name__}: {e})", FIX) from None


def open_lazy(data: bytes, where: str, draft_to: tuple[int, int] | None = None) -> Image.Image:
    """The member's header only (format, mode, size; the bomb check done), with the JPEG draft set up:
    `finish` decodes it. Split from `decode` so a caller can read the header and choose another
    decoder for the pixels, falling back to `finish` for exactly this function's result and errors."""
    with named(where):
        im = Image.open(BytesIO(data))
        if draft_to is not None and im.format == "JPEG":
            im.draft("RGB", (max(1, int(draft_to[0])), max(1, int(draft_to[1]))))
        return im


def finish(im: Image.Image, where: str) -> Image.Image:
    """Decode an `open_lazy` image to RGB (ShardError naming `where` when the data is bad)."""
    with named(where):
        im.load()
        return to_rgb(im)


def decode(data: bytes, where: str, draft_to: tuple[int, int] | None = None) -> Image.Image:
    """Decode one member to RGB. `draft_to` = (width, height) the caller needs at least: a JPEG much
    larger than that is decoded by DCT scaling at the largest 1/2^k size still >= draft_to in both
    sides, so the image returned may be smaller than the stored one (by 2, 4 or 8): callers that
    computed a crop box on the stored size (ShardSet.sizes) scale it by image.size / stored size.
    An undecodable member is a ShardError naming `where` (from ShardSet.where)."""
    return finish(open_lazy(data, where, draft_to), where)
