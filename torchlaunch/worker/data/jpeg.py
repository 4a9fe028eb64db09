"""The training crop's JPEG decoder: libjpeg-turbo through torchvision's image extension, straight to a
uint8 tensor, for the JPEGs PIL would decode to the very same pixels.

Why: at ImageNet size (a 224 px RandomResizedCrop of ~500x375 JPEGs) decoding is most of a sample's
time. PIL and torchvision run libjpeg-turbo with the same settings (accurate integer IDCT, fancy
upsampling), so their RGB pixels are identical (tests/test_jpeg_decode.py, and `decoder` checks it
once per process), but PIL then unpacks every pixel into its 4-byte RGBX storage and the crop is
copied out of that into a numpy array; the tensor decode skips both: ~1.2x the decode + crop + resize
per core (bench/shards.py, docs/BENCHMARKS.md). Decoding less (libjpeg-turbo's region decode at a
DCT scale) is what the issue proposed; neither PIL nor torchvision exposes it, and PyTurboJPEG does
only with TurboJPEG 3, which this platform's libturbojpeg (2.1) is not (the 2.x API has only the
lossless crop transform, which re-encodes the window and measured slower than a whole decode).

Only a header PIL has already read picks this path (boxes.tensor_decodable): PIL still identifies the
format, enforces the decompression-bomb limit and refuses bad headers with its own error, and a CMYK
JPEG, a DCT-scaled (draft) decode or anything the extension refuses is decoded by PIL as before.

The extension library is loaded by itself, not through `import torchvision`: that import pulls in
torchvision's models and ops and with them torch._dynamo (~2.5 s of CPU here), in every DataLoader
worker and in the first-batch budget; the library alone loads in ~5 ms. torchvision 0.29 deprecates
its image decoders; when the library or its op is gone (or decodes differently), `decoder` is None
and PIL decodes everything.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

RGB = 3
"""torchvision.io.ImageReadMode.RGB: grey and YCbCr JPEGs converted to RGB by libjpeg-turbo."""

LIBRARIES = ("image_stable", "image")
"""torchvision's image extension (0.29 builds it against the stable ABI as image_stable)."""


def _library() -> str | None:
    """Path of torchvision's image extension, found without importing torchvision."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = str(Path(next(iter(spec.submodule_search_locations))))
    finder = importlib.machinery.FileFinder(
        folder, (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    )
    for name in LIBRARIES:
        found = finder.find_spec(name)
        if found is not None and found.origin:
            return found.origin
    return None


def _probe() -> bytes:
    """A small 4:2:0 JPEG with noise and colour (every stage: entropy decode, IDCT, upsampling, colour
    conversion) on which the extension must give PIL's pixels exactly."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:48, 0:72]
    arr = np.stack([x * 3, y * 5, (x + y) * 2], -1) + rng.integers(0, 60, (48, 72, 3))
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@functools.cache
def decoder() -> Callable[[torch.Tensor, int, bool], torch.Tensor] | None:
    """torchvision's decode_jpeg op (encoded uint8 tensor, mode, apply EXIF orientation) -> (C, H, W),
    or None when the extension is missing, fails to load, or does not reproduce PIL's pixels."""
    try:
        path = _library()
        if path is None:
            return None
        torch.ops.load_library(path)
        op = torch.ops.image.decode_jpeg
        data = _probe()
        ours = op(torch.frombuffer(bytearray(data), dtype=torch.uint8), RGB, False).permute(1, 2, 0)
        with Image.open(io.BytesIO(data)) as im:
            pil = np.asarray(im.convert("RGB"))
        return op if np.array_equal(ours.numpy(), pil) else None
    except Exception:  # no torchvision, a build without the extension, an op that changed
        return None


def decode_rgb(data: bytes) -> torch.Tensor | None:
    """The JPEG `data` as uint8 (H, W, 3) (a view of libjpeg-turbo's interleaved output, no copy), or
    None when there is no decoder or it refuses the data (truncated, corrupt): the caller then
    decodes with PIL, which names the error if there is one."""
    op = decoder()
    if op is None:
        return None
    try:
        chw = op(torch.frombuffer(bytearray(data), dtype=torch.uint8), RGB, False)
    except (RuntimeError, ValueError):
        return None
    return chw.permute(1, 2, 0)
