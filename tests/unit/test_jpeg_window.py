"""The window decoder (worker/data/_jpeg_window.c through jpeg.decode_window) gives the bytes of a whole
decode cropped, for every box, subsampling, progressive and restart-marker JPEGs, grey, any image size,
and refuses what a whole decode refuses (the training crop falls back to the path it replaced, whose
pixels and errors are then the answer): exact resume rests on a sample's pixels being a function of
(bytes, box, flip) alone, whichever decoder an install has."""

from __future__ import annotations

import functools
import io
import re
import shutil
import sys
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchlaunch.data.shards import ShardError, decode
from torchlaunch.worker.data import jpeg
from torchlaunch.worker.data.augment import crop_resize, draft_request, resized_crop_box
from torchlaunch.worker.data.boxes import decode_box, drafted

SIZE = 56
SOURCE = Path(jpeg.__file__).with_name("_jpeg_window.c")
needs_window = pytest.mark.skipif(jpeg.window_decoder() is None, reason="the window decoder was not built here")


def photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth colour structure plus noise: compresses (and stresses the decoder) like a photo."""
    rng = np.random.default_rng(seed)
    x = np.arange(w)[None, :, None] / 11.0 + np.arange(3)
    y = np.arange(h)[:, None, None] / 7.0
    return np.clip(128 + 70 * np.sin(x) * np.cos(y) + rng.normal(0, 18, (h, w, 3)), 0, 255).astype(np.uint8)


def encode(arr: np.ndarray, mode: str | None = None, **kw) -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(arr)
    (im.convert(mode) if mode else im).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def whole(data: bytes) -> np.ndarray:
    """PIL's decode of the whole image, as RGB: the pixels every tensor path must reproduce."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def window(
    data: bytes, w: int, h: int, box: tuple[int, int, int, int], flip: bool, to_end: bool = True
) -> np.ndarray | None:
    out = jpeg.decode_window(data, w, h, box, flip, to_end)
    return None if out is None else out.numpy()


VARIANTS = {
    "420": {"quality": 90},
    "444": {"quality": 80, "subsampling": 0},
    "422": {"quality": 95, "subsampling": 1},
    "progressive": {"quality": 85, "progressive": True},
    "progressive-444": {"quality": 85, "progressive": True, "subsampling": 0},
    "restart-markers": {"quality": 90, "restart_marker_blocks": 3},
    "restart-rows": {"quality": 75, "restart_marker_rows": 1, "subsampling": 1},
    "optimized": {"quality": 60, "optimize": True},
    "grey": {"quality": 90, "mode": "L"},
    "grey-progressive": {"quality": 90, "mode": "L", "progressive": True},
}

SIZES = [(1, 1), (7, 5), (16, 16), (17, 9), (33, 47), (97, 61), (150, 113), (113, 150), (500, 375)]


def boxes_for(w: int, h: int, rng: np.random.Generator, n: int) -> list[tuple[int, int, int, int]]:
    """Edges and corners, iMCU-aligned and odd offsets, strips, single pixels, the training crop's
    RandomResizedCrop boxes and uniform random ones."""
    out = [(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, 1, 1), (0, h - 1, w, 1), (w - 1, 0, 1, h)]
    if w > 2 and h > 2:
        out += [(1, 1, w - 2, h - 2), (min(16, w - 1), min(8, h - 1), 1, 1)]
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(resized_crop_box(rng.random((10, 4)), w, h))
            continue
        left, top = int(rng.integers(0, w)), int(rng.integers(0, h))
        if rng.random() < 0.3:
            left -= left % 16  # on an iMCU column boundary: the margin reaches into the previous iMCU
        out.append((left, top, int(rng.integers(1, w - left + 1)), int(rng.integers(1, h - top + 1))))
    return out


def test_built_where_it_can_be() -> None:
    """An install with a C compiler and libjpeg-turbo's headers builds the extension (setup.py): a
    silent fallback would lose the speed without a word. Where either is missing, the fallback is the
    design, and this says so as a skip."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = any(Path(d, "jpeglib.h").is_file() for d in ("/usr/include", "/usr/local/include"))
    if not (SOURCE.is_file() and headers and shutil.which(compiler)):
        pytest.skip("no C compiler or libjpeg-turbo headers here: the whole-image decoders serve")
    assert jpeg.window_decoder() is not None, "the window decoder is not built or not loadable: run make install"


@needs_window
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_window_is_the_whole_decode_cropped(variant: str) -> None:
    kw = dict(VARIANTS[variant])
    mode = kw.pop("mode", None)
    rng = np.random.default_rng(7)
    checked = 0
    for w, h in SIZES:
        data = encode(photo(w, h, seed=w), mode, **kw)
        full = whole(data)
        tensor = jpeg.decode_rgb(data)
        if tensor is not None:
            assert np.array_equal(tensor.numpy(), full)  # the two references agree
        for k, (left, top, bw, bh) in enumerate(boxes_for(w, h, rng, 40 if w * h > 1000 else 10)):
            flip = k % 2 == 1
            want = full[top : top + bh, left : left + bw]
            for to_end in (True, False):  # read to the end marker, or stopped after the box
                got = window(data, w, h, (left, top, bw, bh), flip, to_end)
                assert got is not None, (variant, (w, h), (left, top, bw, bh), to_end)
                assert np.array_equal(got, want[:, ::-1] if flip else want), (
                    variant,
                    (w, h),
                    (left, top, bw, bh),
                    flip,
                    to_end,
                )
            checked += 1
    assert checked > 250


@needs_window
def test_the_training_crop_is_the_same_with_and_without_it(monkeypatch) -> None:
    """decode_box through the window decoder == through the whole-image tensor decode == the PIL path
    before either (draft, crop_resize), over the training crop's boxes and flips."""
    rng = np.random.default_rng(3)
    cases = []
    for w, h in ((500, 375), (375, 500), (150, 113)):
        for kw in ({"quality": 90}, {"quality": 90, "progressive": True}, {"quality": 90, "subsampling": 0}):
            data = encode(photo(w, h, seed=h), **kw)
            for k in range(6):
                cases.append((data, w, h, resized_crop_box(rng.random((10, 4)), w, h), k % 2 == 1))
    ours = [decode_box(data, "m", w, h, box, SIZE, flip) for data, w, h, box, flip in cases]
    monkeypatch.setattr(jpeg, "window_decoder", lambda: None)
    for got, (data, w, h, box, flip) in zip(ours, cases, strict=True):
        assert torch.equal(got, decode_box(data, "m", w, h, box, SIZE, flip))
        pil = crop_resize(decode(data, "m", draft_request(w, h, box[2], box[3], SIZE)), w, h, box, SIZE, flip)
        assert torch.equal(got, pil)


def forge_size(data: bytes, w: int, h: int) -> bytes:
    """The frame header (SOF0/SOF2) rewritten to say w x h; the scan data stays the small image's."""
    out = bytearray(data)
    at = max(out.find(b"\xff\xc0"), out.find(b"\xff\xc2"))
    out[at + 5 : at + 9] = h.to_bytes(2, "big") + w.to_bytes(2, "big")
    return bytes(out)


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def bogus_huffman(data: bytes) -> bytes:
    out = bytearray(data)
    dht = out.index(b"\xff\xc4")
    out[dht + 5 : dht + 21] = b"\xff" * 16
    return bytes(out)


@needs_window
def test_bad_data_and_bad_boxes_are_refused_in_one_line() -> None:
    """None from decode_window (the caller falls back), and from the module one ValueError line: every
    libjpeg error and warning, a header of another size, a box not inside the image. Forged sizes are
    refused without decoding or allocating what they claim (no hang, no memory blow-up)."""
    w, h = 150, 113
    data = encode(photo(w, h))
    progressive = encode(photo(16, 16), progressive=True)
    box = (10, 10, 100, 80)
    bad = {
        "truncated-half": (data[: len(data) // 2], w, h, box),
        "truncated-end": (data[:-2], w, h, box),  # the end marker alone missing
        "truncated-header": (data[:300], w, h, box),
        "huffman": (bogus_huffman(data), w, h, box),
        "garbage": (b"\xff\xd8\xff garbage", w, h, box),
        "empty": (b"", w, h, box),
        "png": (png(photo(w, h)), w, h, box),
        "cmyk": (encode(photo(w, h), "CMYK"), w, h, box),
        "other-size": (data, w + 1, h, box),
        "forged-huge": (forge_size(data, 60000, 60000), 60000, 60000, (0, 0, 64, 64)),
        "forged-huge-progressive": (forge_size(progressive, 60000, 60000), 60000, 60000, (0, 0, 16, 16)),
        "forged-large": (forge_size(data, 4000, 3000), 4000, 3000, (200, 2000, 64, 64)),
        "box-right": (data, w, h, (100, 10, 51, 10)),
        "box-below": (data, w, h, (0, 100, 10, 14)),
        "box-negative": (data, w, h, (-1, 0, 10, 10)),
        "box-empty": (data, w, h, (5, 5, 0, 10)),
        "box-huge": (data, w, h, (0, 0, 2**40, 2**40)),
    }
    decode_fn = jpeg.window_decoder()
    for name, (payload, pw, ph, (left, top, bw, bh)) in bad.items():
        assert jpeg.decode_window(payload, pw, ph, (left, top, bw, bh), False) is None, name
        for to_end in (True, False):
            if name.startswith("truncated-") and name != "truncated-header" and not to_end:
                continue  # the damage is below the box: only a decode to the end meets it (the proof's point)
            with pytest.raises((ValueError, OverflowError)) as refused:
                decode_fn(payload, pw, ph, left, top, bw, bh, False, to_end)
            assert str(refused.value) and "\n" not in str(refused.value), (name, str(refused.value))


@needs_window
@pytest.mark.parametrize("where", ["below", "right", "in"])
def test_damage_outside_the_box_is_refused_as_a_whole_decode_refuses_it(where: str) -> None:
    """Damage below or beside the box does not touch the box's pixels, but a whole decode refuses the
    image, and so must the window (the rest of the stream is entropy-decoded and read to its end): a
    member is refused on its first draw, whichever box it gets, with the very ShardError of before."""
    w, h = 500, 375
    data = bytearray(encode(photo(w, h)))
    scan = data.index(b"\xff\xda")
    at = {"below": len(data) - 200, "right": scan + (len(data) - scan) // 20, "in": scan + (len(data) - scan) // 2}[
        where
    ]
    data[at : at + 6] = b"\xa5\xff\x37\x00\x11\xff"
    damaged = bytes(data)
    box = (0, 0, 60, 40) if where != "right" else (0, 0, 16, 375)
    assert jpeg.decode_rgb(damaged) is None  # the premise: a whole decode refuses it
    assert jpeg.decode_window(damaged, w, h, box, False) is None
    with pytest.raises(ShardError) as old:
        crop_resize(decode(damaged, "m", draft_request(w, h, box[2], box[3], SIZE)), w, h, box, SIZE, False)
    with pytest.raises(ShardError) as new:
        decode_box(damaged, "m", w, h, box, SIZE, False)
    assert re.sub(r"0x[0-9a-f]+", "0x?", str(new.value)) == re.sub(r"0x[0-9a-f]+", "0x?", str(old.value))


@needs_window
def test_damaged_data_the_window_decodes_is_what_a_whole_decode_gives() -> None:
    """Random damage to a plain JPEG's bytes: what the window decoder returns, the whole-image decoders
    return too (same pixels); what it refuses, the caller's whole-image path decides as before."""
    rng = np.random.default_rng(5)
    seeds = [encode(photo(48, 40, s), **kw) for s, kw in enumerate(({"quality": 90}, {"progressive": True}))]
    seeds.append(encode(photo(48, 40), "L", restart_marker_blocks=2))
    decoded = refused = 0
    for t in range(600):
        data = bytearray(seeds[t % len(seeds)])
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(2, len(data)))] = int(rng.integers(0, 256))
        damaged = bytes(data)
        if jpeg.plain_size(damaged) != (48, 40):
            continue
        box = (int(rng.integers(0, 24)), int(rng.integers(0, 20)), 20, 17)
        got = window(damaged, 48, 40, box, False)
        if got is None:
            refused += 1
            continue
        full = whole(damaged)
        assert np.array_equal(got, full[box[1] : box[1] + 17, box[0] : box[0] + 20])
        tensor = jpeg.decode_rgb(damaged)
        assert tensor is None or np.array_equal(tensor.numpy(), full)
        decoded += 1
    assert decoded > 50 and refused > 50


def test_a_decoder_that_is_not_pils_is_not_used(monkeypatch) -> None:
    """The once-per-process check: a window decoder whose pixels differ from PIL's on the probe (another
    libjpeg, other settings) is never used; a missing one leaves the whole-image decoders."""
    import torchlaunch.worker.data as package

    name = "torchlaunch.worker.data._jpeg_window"

    def grey(
        data: bytes, w: int, h: int, left: int, top: int, cols: int, rows: int, flip: bool, to_end: bool
    ) -> bytearray:
        return bytearray(b"\x80" * (cols * rows * 3))

    jpeg.window_decoder.cache_clear()
    try:
        monkeypatch.setattr(package, "_jpeg_window", types.SimpleNamespace(decode=grey), raising=False)
        monkeypatch.setitem(sys.modules, name, package._jpeg_window)
        assert jpeg.window_decoder() is None
        jpeg.window_decoder.cache_clear()

        def stale(
            data: bytes, w: int, h: int, left: int, top: int, cols: int, rows: int, flip: bool, to_end: bool
        ) -> bytearray:  # PIL's pixels everywhere, a progressive stream cut short included (issue 52)
            out = whole(data)[top : top + rows, left : left + cols]
            return bytearray((out[:, ::-1] if flip else out).tobytes())

        package._jpeg_window.decode = stale
        assert jpeg.window_decoder() is None
        jpeg.window_decoder.cache_clear()
        monkeypatch.delattr(package, "_jpeg_window")
        monkeypatch.setitem(sys.modules, name, None)  # import fails: not built, or its libjpeg missing
        assert jpeg.window_decoder() is None
        assert jpeg.decode_window(encode(photo(20, 20)), 20, 20, (0, 0, 5, 5), False) is None
    finally:
        monkeypatch.undo()
        jpeg.window_decoder.cache_clear()


@needs_window
def test_a_member_is_proven_once_and_then_decoded_to_its_box_only() -> None:
    """decode_box's proof: a member not yet proven is decoded to its end marker and, clean, proven (the
    callback runs once); a proven one stops after its box. The pixels are the same either way and the
    same as the whole-image tensor decode's and the PIL path's."""
    rng = np.random.default_rng(11)
    for w, h in ((500, 375), (375, 500), (150, 113)):
        data = encode(photo(w, h, seed=w))
        for k in range(4):
            box, flip = resized_crop_box(rng.random((10, 4)), w, h), k % 2 == 1
            proofs: list[int] = []
            first = decode_box(data, "m", w, h, box, SIZE, flip, False, functools.partial(proofs.append, 1))
            later = decode_box(data, "m", w, h, box, SIZE, flip, True, functools.partial(proofs.append, 2))
            request = draft_request(w, h, box[2], box[3], SIZE)
            pil = crop_resize(decode(data, "m", request), w, h, box, SIZE, flip)
            assert torch.equal(first, later) and torch.equal(first, pil)
            assert proofs == ([] if drafted(w, h, request) else [1]), (box, proofs)  # a PIL draft proves nothing


@needs_window
@pytest.mark.parametrize("where", ["below", "right"])
def test_a_member_damaged_outside_its_box_is_never_proven(where: str) -> None:
    """A member whose damage a decode stopped after the box would not meet: refused, with the error line
    of before, and no proof recorded, so no later draw of it stops early: it is refused at every draw,
    whichever box it gets, as the whole decode refused it before the window decoder existed."""
    w, h = 500, 375
    data = bytearray(encode(photo(w, h)))
    scan = data.index(b"\xff\xda")
    at = {"below": len(data) - 200, "right": scan + (len(data) - scan) // 20}[where]
    data[at : at + 6] = b"\xa5\xff\x37\x00\x11\xff"
    damaged = bytes(data)
    box = (0, 0, 60, 40) if where != "right" else (0, 0, 16, 375)
    proofs: list[int] = []
    for _ in range(3):
        with pytest.raises(ShardError, match="cannot be decoded"):
            decode_box(damaged, "m", w, h, box, SIZE, False, False, functools.partial(proofs.append, 1))
    assert proofs == []
    if where == "below":
        assert window(damaged, w, h, box, False, to_end=False) is not None  # what an unproven early stop would do


def test_clean_decode_records_are_shared_by_subsets_and_fresh_when_pickled() -> None:
    """ShardSamples' proofs: keyed by the set's sample (a subset's position i is its index[i]), shared by
    the subsets of one split (the training loader's), and a pickled copy (a spawned worker) starts with
    none: proofs never travel beyond the processes that share the mapping."""
    import pickle

    from torchlaunch.worker.data.shards import CleanDecodes, ShardSamples

    class Set:
        fingerprint = "f"

        def __len__(self) -> int:
            return 10

    samples = ShardSamples(Set())
    part = samples.subset([7, 3])
    assert not part.decodes_clean(0)
    part.record_clean(0)
    assert samples.decodes_clean(7) and part.decodes_clean(0) and not part.decodes_clean(1)
    copy = pickle.loads(pickle.dumps(samples.clean))
    assert isinstance(copy, CleanDecodes) and 7 not in copy and 7 in samples.clean


FIXTURES = Path(__file__).parents[1] / "fixtures" / "jpeg"
"""Arithmetic-coded JPEGs (SOF9, SOF10 with DAC), which PIL cannot write: photo(48, 40, 9) encoded by PIL
at quality 90, transcoded by libjpeg-turbo 2.1.5's `jpegtran -arithmetic [-progressive]`."""


def by_pil(data: bytes, w: int, h: int, box: tuple[int, int, int, int], flip: bool) -> torch.Tensor | str:
    """The training crop through PIL alone (the path before any tensor decoder), or its error line."""
    try:
        return crop_resize(decode(data, "m", draft_request(w, h, box[2], box[3], SIZE)), w, h, box, SIZE, flip)
    except ShardError as e:
        return re.sub(r"0x[0-9a-f]+", "0x?", str(e))


def by_us(data: bytes, w: int, h: int, box: tuple[int, int, int, int], flip: bool, proven: bool) -> torch.Tensor | str:
    try:
        return decode_box(data, "m", w, h, box, SIZE, flip, proven)
    except ShardError as e:
        return re.sub(r"0x[0-9a-f]+", "0x?", str(e))


def same(a: torch.Tensor | str, b: torch.Tensor | str) -> bool:
    return a == b if isinstance(a, str) or isinstance(b, str) else torch.equal(a, b)


def crafted() -> dict[str, bytes]:
    out = {p.stem: p.read_bytes() for p in sorted(FIXTURES.glob("*.jpg"))}
    out["huffman-progressive"] = encode(photo(48, 40, 9), quality=90, progressive=True)
    out["huffman-baseline"] = encode(photo(48, 40, 9), quality=90)
    return out


def test_arithmetic_coded_jpegs_take_pils_path() -> None:
    """Issue 52: an arithmetic-coded progressive JPEG cut short with an end marker, which PIL decodes,
    came out of the window decoder up to 30 levels off PIL's pixels. The tensor decoders take only
    Huffman-coded frames; the rest is PIL's to decode."""
    files = crafted()
    assert len(files) == 4 and all(jpeg.huffman_coded(d) == k.startswith("huffman") for k, d in files.items())
    arithmetic = files["arithmetic-progressive"]
    cut = arithmetic[: len(arithmetic) // 3] + b"\xff\xd9"
    assert jpeg.decode_window(cut, 48, 40, (0, 0, 48, 40), False) is None and jpeg.decode_rgb(cut) is None
    assert not jpeg.huffman_coded(b"\xff\xd8") and not jpeg.huffman_coded(b"")


@needs_window
def test_a_progressive_stream_cut_short_is_refused_by_the_window_decoder() -> None:
    """Scans missing (an end marker before the last ones: libjpeg warns of nothing) leave coefficients
    unknown and libjpeg smooths the blocks, differently from one libjpeg-turbo to another: refused, so
    the caller's whole-image path decides."""
    data = crafted()["huffman-progressive"]
    assert window(data, 48, 40, (0, 0, 48, 40), False) is not None
    scans = [m.start() for m in re.finditer(b"\xff\xda", data)]
    assert len(scans) > 3
    for at in scans[1:]:
        cut = data[:at] + b"\xff\xd9"
        assert whole(cut).shape == (40, 48, 3)  # PIL decodes it
        for to_end in (True, False):
            assert window(cut, 48, 40, (0, 0, 48, 40), False, to_end) is None, at


def test_crafted_and_cut_short_jpegs_give_pils_pixels() -> None:
    """The crafted files, whole and cut at 24 points (each with an end marker after the cut, and
    without), under several boxes and flips: decode_box gives PIL's pixels exactly, or PIL's error."""
    checked = 0
    for name, data in crafted().items():
        for k in range(25):
            end = len(data) - 2 if k == 24 else 2 + (len(data) - 2) * k // 24
            for tail in (b"\xff\xd9", b"") if k < 24 else (data[-2:],):
                cut = data[:end] + tail
                for box, flip in (((0, 0, 48, 40), False), ((5, 3, 30, 29), True), ((17, 21, 31, 19), False)):
                    want = by_pil(cut, 48, 40, box, flip)
                    assert same(by_us(cut, 48, 40, box, flip, False), want), (name, end, tail, box)
                    checked += isinstance(want, torch.Tensor)
    assert checked > 100


@pytest.mark.timeout(120)
def test_a_fuzzed_corpus_gives_pils_pixels_or_pils_error() -> None:
    """Seeded, bounded mutations (bytes overwritten, cut short with or without an end marker, a run of
    bytes removed) of Huffman and arithmetic, baseline and progressive, restart-marker and grey JPEGs:
    decode_box, unproven and then proven as a later draw would be, is the PIL path's result exactly."""
    rng = np.random.default_rng(52)
    seeds = [*crafted().values(), encode(photo(48, 40, 3), "L", progressive=True)]
    seeds.append(encode(photo(48, 40, 4), quality=80, restart_marker_blocks=2, subsampling=0))
    decoded = 0
    for t in range(500):
        data = bytearray(seeds[t % len(seeds)])
        kind = t // len(seeds) % 3
        if kind == 0:
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(2, len(data)))] = int(rng.integers(0, 256))
        elif kind == 1:
            data = data[: int(rng.integers(100, len(data)))] + (b"\xff\xd9" if rng.random() < 0.7 else b"")
        else:
            at = int(rng.integers(100, len(data) - 10))
            del data[at : at + int(rng.integers(1, 40))]
        box = (int(rng.integers(0, 24)), int(rng.integers(0, 20)), int(rng.integers(1, 25)), int(rng.integers(1, 21)))
        flip = bool(rng.random() < 0.5)
        want = by_pil(bytes(data), 48, 40, box, flip)
        first = by_us(bytes(data), 48, 40, box, flip, False)
        assert same(first, want), (t, kind, box)
        if isinstance(want, torch.Tensor):
            decoded += 1
            assert same(by_us(bytes(data), 48, 40, box, flip, True), want), (t, kind, box)
    assert decoded > 100
