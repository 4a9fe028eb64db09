"""The training crop's JPEG decoders: libjpeg-turbo through this package's window decoder (the box alone)
or torchvision's image extension (the whole image), straight to a uint8 tensor, for the JPEGs PIL would
decode to the very same pixels.

Why: at ImageNet size (a 224 px RandomResizedCrop of ~500x375 JPEGs) decoding is most of a sample's
time. PIL and torchvision run libjpeg-turbo with the same settings (accurate integer IDCT, fancy
upsampling), so their RGB pixels are identical (tests/unit/test_jpeg_decode.py, and `decoder` checks it
once per process), but PIL then unpacks every pixel into its 4-byte RGBX storage and the crop is
copied out of that into a numpy array; the tensor decode skips both, and a plain header skips PIL's
Image.open: ~1.25x the decode + crop + resize per core at 500x375 (bench/shards.py, project ÷
project_pil, docs/BENCHMARKS.md). Decoding less (libjpeg-turbo's region decode at a
DCT scale) is what the issue proposed; neither PIL nor torchvision exposes it, and PyTurboJPEG does
only with TurboJPEG 3, which this platform's libturbojpeg (2.1) is not (the 2.x API has only the
lossless crop transform, which re-encodes the window and measured slower than a whole decode).

Window (region-of-interest) decode, adopted 2026-12-06 with a per-member proof (decode_window,
window_decoder; the C source is _jpeg_window.c, built by setup.py, optional). libjpeg-turbo's libjpeg API
(>= 1.5; Debian's libjpeg62-turbo 2.1.5 here) decodes a window without TurboJPEG 3: jpeg_crop_scanline
for the columns, jpeg_skip_scanlines for the rows above, only the window inverse-transformed, upsampled
and colour-converted (the window widened by 2 px each side for fancy upsampling's context and cropped
in C): the whole decode's bytes on every box, subsampling, progressive and restart-marker JPEG and grey
image the tests try (tests/unit/test_jpeg_window.py). Per core, one thread, bench/loader224's 640 JPEGs
under RandomResizedCrop boxes (mean 42% of the area), decode + crop: whole 1.33 ms, window stopping
after the box's last row 1.01 ms (1.35x), window that also entropy-decodes the rows below and reads to
EOI 1.20 ms (1.12x). Only the latter refuses what a whole decode refuses: libjpeg finds truncation or
corruption below the box only by decoding it, so stopping early would train on a member that the whole
decode refuses, and refuse it only in the epochs whose box reached the damage. Hence the proof: a
member's first draw in a run reads the stream to its end marker (refusing as before); a success is
recorded in memory the DataLoader workers share (worker/data/shards.CleanDecodes), and its later
draws, of the very bytes (each read is checked against the member's checksum), stop after the box.
Nothing on disk records or claims the proof, so no index can forge it. Huffman decoding, which no window
avoids, is most of what remains. Not adopted: the same decoder at a DCT scale for the draft cases
(pixels identical to PIL's draft, but 1.91 ms against PIL's 1.95 ms for the whole scaled image).

Which JPEGs: a plain header (`plain_size`: the subset of headers PIL opens without a question, checked
here as PIL checks it, bomb limit included) skips Image.open too (~10% of a sample's time); any other
JPEG PIL opens as RGB or grey (EXIF, ICC, Adobe segments...) is opened by PIL and then decoded here
(boxes.tensor_decodable). A CMYK JPEG, an arithmetic-coded or other non-Huffman frame (huffman_coded), a
DCT-scaled (draft) decode, another format, a bad header and anything the extension refuses (a
progressive stream cut short among them: _jpeg_window.c's scans_complete) are decoded by PIL as before,
with its errors.

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


def _probe(progressive: bool = False) -> bytes:
    """A small 4:2:0 JPEG with noise and colour (every stage: entropy decode, IDCT, upsampling, colour
    conversion) on which the extension must give PIL's pixels exactly."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:48, 0:72]
    arr = np.stack([x * 3, y * 5, (x + y) * 2], -1) + rng.integers(0, 60, (48, 72, 3))
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90, progressive=progressive)
    return buf.getvalue()


def _cut_probe() -> bytes:
    """The progressive probe cut short after its first scan, with an end marker: the window decoder must
    refuse it (a build older than its scans_complete check decodes it, with pixels PIL's need not match)."""
    data = _probe(progressive=True)
    return data[: data.index(b"\xff\xda", data.index(b"\xff\xda") + 2)] + b"\xff\xd9"


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


PLAIN_SOF = {0xC0, 0xC1, 0xC2}
"""Baseline, extended sequential and progressive Huffman frames: what cameras and encoders write."""

PLAIN_SKIPPED = {0xC4, 0xDD, 0xFE}
"""DHT, DRI, COM: segments PIL's header parser only skips or stores."""


def plain_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG whose header PIL would read without a question: SOI, then only
    well-formed JFIF APP0, DQT, DHT, DRI and COM segments and one 8-bit grey or 3-component baseline or
    progressive frame before the first scan, within the decompression-bomb limit; else None (anything
    else: EXIF, ICC, Adobe, MPF segments, CMYK, padding, junk, a short or overlong segment, another
    format), and the caller opens it with PIL as before. For the headers accepted, every check PIL's
    JpegImagePlugin makes is made here too (segment lengths, quantisation table sizes, the frame's
    precision and layers, the size limit), so PIL would open them, as RGB or L, at this size: skipping
    Image.open (~10% of a sample's time at 500x375) changes no result and no error."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    pos, end, size = 2, len(data), None
    while True:
        if pos + 4 > end or data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2 or pos + 2 + length > end:
            return None
        segment = data[pos + 4 : pos + 2 + length]
        if marker == 0xDA:  # start of scan: the header is over
            break
        if marker in PLAIN_SOF:
            if size is not None or len(segment) < 6 or segment[0] != 8 or segment[5] not in (1, 3):
                return None
            size = ((segment[3] << 8) | segment[4], (segment[1] << 8) | segment[2])
        elif marker == 0xDB:
            table = segment
            while table:
                span = 1 + (64 if table[0] < 16 else 128)
                if len(table) < span:
                    return None
                table = table[span:]
        elif marker == 0xE0:
            if not segment.startswith(b"JFIF\x00") or len(segment) < 14:
                return None
        elif marker not in PLAIN_SKIPPED:
            return None
        pos += 2 + length
    if size is None or size[0] <= 0 or size[1] <= 0:
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and size[0] * size[1] > limit:
        return None  # PIL warns or refuses: its path says so
    return size


SOF_MARKERS = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
"""Every start-of-frame marker (DHT, JPG and DAC share the range)."""


def huffman_coded(data: bytes) -> bool:
    """Whether `data` starts as a JPEG with one Huffman-coded frame (baseline, extended sequential or
    progressive: PLAIN_SOF) and no arithmetic-coding tables before its first scan (pure, the header's
    segments only). The tensor decoders are used only for these: an arithmetic-coded JPEG (SOF9-11, DAC)
    cut short decoded differently from PIL on this system's libjpeg-turbo (issue 52: up to 8 levels), and
    the other frames are rare enough that PIL's path costs nothing worth a second proof."""
    if not data.startswith(b"\xff\xd8"):
        return False
    pos, end, frame = 2, len(data), None
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0xDA:
            return frame in PLAIN_SOF
        if marker == 0xCC or (marker in SOF_MARKERS and frame is not None):
            return False
        if marker in SOF_MARKERS:
            frame = marker
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return False


WindowFn = Callable[[bytes, int, int, int, int, int, int, bool, bool], bytearray]
"""_jpeg_window.decode(data, width, height, left, top, cols, rows, flip, to_end) -> rows * cols * 3 RGB bytes."""

PROBE_WINDOWS = (
    (0, 0, 72, 48, False),  # the whole image: no crop, no skip
    (1, 1, 70, 46, True),  # one pixel in from every edge (the widened window meets the image's edges)
    (16, 8, 20, 17, False),  # left on an iMCU boundary: the margin reaches into the previous one
    (17, 9, 31, 30, True),  # odd offsets and sizes, mirrored
    (33, 20, 5, 3, False),  # a few pixels inside one iMCU
    (50, 30, 22, 18, True),  # the bottom-right corner
)
"""Windows of the 72x48 4:2:0 probe that cover the window decoder's edge cases."""


@functools.cache
def window_decoder() -> WindowFn | None:
    """The compiled window decoder (torchlaunch/worker/data/_jpeg_window.c, built by setup.py), or None
    when the install could not build it (no compiler or libjpeg-turbo headers: the extension is
    optional), it does not load (the system's libjpeg missing at run time), it does not give PIL's
    pixels on every probe window, stopping early or not, or it decodes a progressive stream cut short
    (a build from before that refusal; checked once per process): the callers then
    decode the whole image as before."""
    try:
        from torchlaunch.worker.data import _jpeg_window  # type: ignore[attr-defined]

        data = _probe()
        with Image.open(io.BytesIO(data)) as im:
            pil = np.asarray(im.convert("RGB"))
        for left, top, cols, rows, flip in PROBE_WINDOWS:
            want = pil[top : top + rows, left : left + cols]
            for to_end in (True, False):
                got = np.frombuffer(_jpeg_window.decode(data, 72, 48, left, top, cols, rows, flip, to_end), np.uint8)
                if not np.array_equal(got.reshape(rows, cols, 3), want[:, ::-1] if flip else want):
                    return None
        try:
            _jpeg_window.decode(_cut_probe(), 72, 48, 0, 0, 72, 48, False, True)
            return None  # a stale build: it decodes what it must leave to PIL
        except ValueError:
            return _jpeg_window.decode
    except Exception:  # not built, a missing shared library, a build against another libjpeg
        return None


def available() -> bool:
    """Whether a tensor decoder (the window decoder or torchvision's) gives PIL's pixels here."""
    return window_decoder() is not None or decoder() is not None


def decode_window(
    data: bytes, width: int, height: int, box: tuple[int, int, int, int], flip: bool, to_end: bool = True
) -> torch.Tensor | None:
    """The whole-pixel box (left, top, w, h) of the width x height JPEG `data`, mirrored when `flip`, as a
    contiguous uint8 (h, w, 3) tensor decoded alone (only the box's pixels are inverse-transformed,
    upsampled and colour-converted), the bytes of decode_rgb's image cropped (and mirrored); None when
    there is no window decoder, the JPEG is not Huffman-coded (huffman_coded), the header says another
    size, the box is not inside the image, the progressive scans stop short (_jpeg_window.c), or
    libjpeg errs or warns (corrupt or truncated data): the caller then takes the whole-image path,
    which decodes or names the error as it did before this decoder existed.

    `to_end` (the default) entropy-decodes the rest of the stream and reads it to its end marker, so a
    JPEG damaged anywhere is refused as a whole decode refuses it, and a success proves the whole
    stream clean. to_end=False stops after the box's last row (~1.3x faster at 500x375): only for bytes
    already proven clean that way (boxes.decode_box's `proven`), else a member damaged below the box
    would be trained on in the epochs whose box stays above the damage."""
    fn = window_decoder()
    if fn is None or not huffman_coded(data):
        return None
    left, top, cols, rows = box
    try:
        out = fn(data, width, height, left, top, cols, rows, flip, to_end)
    except (ValueError, TypeError, OverflowError):
        return None
    return torch.frombuffer(out, dtype=torch.uint8).view(rows, cols, 3)


def decode_rgb(data: bytes) -> torch.Tensor | None:
    """The JPEG `data` as uint8 (H, W, 3) (a view of libjpeg-turbo's interleaved output, no copy), or
    None when there is no decoder, the JPEG is not Huffman-coded (huffman_coded) or the decoder refuses
    the data (truncated, corrupt): the caller then
    decodes with PIL, which names the error if there is one."""
    op = decoder()
    if op is None or not huffman_coded(data):
        return None
    try:
        chw = op(torch.frombuffer(bytearray(data), dtype=torch.uint8), RGB, False)
    except (RuntimeError, ValueError):
        return None
    return chw.permute(1, 2, 0)
