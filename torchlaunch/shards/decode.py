"""The CPU decoder of shard members: encoded bytes -> an RGB PIL image.

PIL is the decoder by measurement (bench/shards.py, docs/BENCHMARKS.md): with draft mode (libjpeg's
DCT scaling, decoding at 1/2, 1/4 or 1/8 size when the target is that much smaller) it is the fastest
per core of those measured, and it already handles every mode a real set holds (ImageNet has CMYK and
grayscale JPEGs and a PNG named .JPEG). Every mode ends as 8-bit RGB here, so callers see one format.
"""

from __future__ import annotations

from io import BytesIO

import numpy as np
from PIL import Image

from torchlaunch.shards.errors import ShardError

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


def decode(data: bytes, where: str, draft_to: tuple[int, int] | None = None) -> Image.Image:
    """Decode one member to RGB. `draft_to` = (width, height) the caller needs at least: a JPEG much
    larger than that is decoded by DCT scaling at the largest 1/2^k size still >= draft_to in both
    sides, so the image returned may be smaller than the stored one (by 2, 4 or 8): callers that
    computed a crop box on the stored size (ShardSet.sizes) scale it by image.size / stored size.
    An undecodable member is a ShardError naming `where` (from ShardSet.where)."""
    try:
        im = Image.open(BytesIO(data))
        if draft_to is not None and im.format == "JPEG":
            im.draft("RGB", (max(1, int(draft_to[0])), max(1, int(draft_to[1]))))
        im.load()
        return to_rgb(im)
    except Image.DecompressionBombError as e:
        raise ShardError(f"{where} is too large to decode ({str(e).split(' could be')[0]})", FIX) from None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error... for bad data
        raise ShardError(f"{where} cannot be decoded ({type(e).__name__}: {e})", FIX) from None
