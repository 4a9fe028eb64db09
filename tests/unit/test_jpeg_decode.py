"""The training crop's tensor JPEG decode (worker/data/jpeg.py, boxes.decode_box and load_box) gives the
pixels and the errors of the PIL path it replaces: exact resume and the world-size invariance of the
resized crop rest on a sample's pixels being a function of (bytes, box, flip) alone."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchlaunch.data.shards import ShardError, decode
from torchlaunch.data.shards.decode import open_lazy
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data import jpeg
from torchlaunch.worker.data.augment import crop_resize, draft_request, resized_crop_box
from torchlaunch.worker.data.boxes import decode_box, load_box, tensor_decodable

pytestmark = pytest.mark.skipif(jpeg.decoder() is None, reason="torchvision without its JPEG decoder")

SIZE = 56


def photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth colour structure plus noise: compresses (and stresses the decoder) like a photo."""
    rng = np.random.default_rng(seed)
    x = np.arange(w)[None, :, None] / 13.0 + np.arange(3)
    y = np.arange(h)[:, None, None] / 9.0
    base = 128 + 70 * np.sin(x) * np.cos(y)
    return np.clip(base + rng.normal(0, 18, (h, w, 3)), 0, 255).astype(np.uint8)


def encode(arr: np.ndarray, mode: str | None = None, fmt: str = "JPEG", **kw) -> bytes:
    im = Image.fromarray(arr)
    buf = io.BytesIO()
    (im.convert(mode) if mode else im).save(buf, format=fmt, **kw)
    return buf.getvalue()


def old_path(data: bytes, w: int, h: int, box, flip: bool) -> torch.Tensor:
    """What the loader did before the tensor decode: PIL with the box's draft, then crop_resize."""
    return crop_resize(decode(data, "m", draft_request(w, h, box[2], box[3], SIZE)), w, h, box, SIZE, flip)


VARIANTS = {
    "420": {"quality": 90},
    "444": {"quality": 80, "subsampling": 0},
    "422": {"quality": 95, "subsampling": 1},
    "progressive": {"quality": 85, "progressive": True},
    "restart-markers": {"quality": 90, "restart_marker_blocks": 3},
    "grey": {"quality": 90, "mode": "L"},
    "cmyk": {"quality": 90, "mode": "CMYK"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_same_pixels_as_pils_decode_for_every_box_and_flip(variant: str) -> None:
    kw = dict(VARIANTS[variant])
    mode = kw.pop("mode", None)
    rng = np.random.default_rng(1)
    fast = 0
    for w, h in ((150, 113), (113, 150), (97, 61), (320, 240)):  # 320x240: big boxes draft at 1/2
        data = encode(photo(w, h), mode, **kw)
        assert (jpeg.plain_size(data) == (w, h)) is (variant != "cmyk")  # PIL's Image.open skipped
        for k in range(8):
            box, flip = resized_crop_box(rng.random((10, 4)), w, h), bool(k % 2)
            ours = decode_box(data, "m", w, h, box, SIZE, flip)
            assert torch.equal(ours, old_path(data, w, h, box, flip)), (variant, (w, h), box, flip)
            assert torch.equal(decode_box(data, "m", w, h, box, SIZE, flip), ours)  # run to run
            fast += tensor_decodable(open_lazy(data, "m", draft_request(w, h, box[2], box[3], SIZE)), w, h, box)
    if variant == "cmyk":
        assert fast == 0  # libjpeg-turbo's CMYK -> RGB is not PIL's: PIL decodes these
    else:
        assert fast >= 24  # the tensor path did the work (not a PIL fallback that proves nothing)


def test_a_png_member_and_a_drafted_jpeg_decode_through_pil() -> None:
    arr = photo(120, 90)
    png = encode(arr, fmt="PNG")
    box = (10, 5, 80, 60)
    assert not tensor_decodable(open_lazy(png, "m", draft_request(120, 90, 80, 60, SIZE)), 120, 90, box)
    assert torch.equal(decode_box(png, "m", 120, 90, box, SIZE, True), old_path(png, 120, 90, box, True))
    big = encode(photo(640, 480))
    whole = (0, 0, 640, 480)  # 640 px onto 56: the draft decodes at 1/8
    assert not tensor_decodable(open_lazy(big, "m", draft_request(640, 480, 640, 480, SIZE)), 640, 480, whole)
    assert torch.equal(decode_box(big, "m", 640, 480, whole, SIZE, False), old_path(big, 640, 480, whole, False))


def bogus_huffman(data: bytes) -> bytes:
    """The header reads, the image does not (tests/unit/test_shards.py's 'undecodable' member)."""
    out = bytearray(data)
    dht = out.index(b"\xff\xc4")
    out[dht + 5 : dht + 21] = b"\xff" * 16
    return bytes(out)


@pytest.mark.parametrize("damage", ["truncated", "huffman", "garbage", "empty"])
def test_bad_data_is_the_same_shard_error(damage: str) -> None:
    data = encode(photo(150, 113))
    bad = {
        "truncated": data[: len(data) // 2],
        "huffman": bogus_huffman(data),
        "garbage": b"\xff\xd8\xff garbage",
        "empty": b"",
    }[damage]
    box = (10, 10, 100, 80)
    with pytest.raises(ShardError) as old:
        old_path(bad, 150, 113, box, False)
    with pytest.raises(ShardError) as new:
        decode_box(bad, "m", 150, 113, box, SIZE, False)
    same = re.sub(r"0x[0-9a-f]+", "0x?", str(new.value)) == re.sub(r"0x[0-9a-f]+", "0x?", str(old.value))
    assert same and str(new.value).startswith("data error: m cannot be decoded")  # (a BytesIO's address aside)


def test_a_decompression_bomb_is_refused_before_any_decoder_runs(monkeypatch) -> None:
    data = encode(photo(150, 113))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 150 * 113 // 3)  # over twice the limit: refused

    def no_decode(_data: bytes) -> None:
        raise AssertionError("decoded a decompression bomb")

    monkeypatch.setattr(jpeg, "decode_rgb", no_decode)
    with pytest.raises(ShardError, match=r"^data error: m is too large to decode \(Image size \(16950 pixels\)"):
        decode_box(data, "m", 150, 113, (0, 0, 100, 100), SIZE, False)


def test_an_index_size_that_is_not_the_images_decodes_through_pil() -> None:
    """A member whose stored size disagrees with the index (a forged or rewritten shard): PIL's
    scaled box as before, not a tensor crop at the wrong coordinates."""
    data = encode(photo(150, 113))
    box = (0, 0, 200, 150)
    assert not tensor_decodable(open_lazy(data, "m", draft_request(300, 226, 200, 150, SIZE)), 300, 226, box)
    assert torch.equal(decode_box(data, "m", 300, 226, box, SIZE, False), old_path(data, 300, 226, box, False))


def test_without_torchvisions_decoder_pil_gives_the_same(monkeypatch) -> None:
    data = encode(photo(150, 113))
    box = (20, 7, 90, 101)
    ours = decode_box(data, "m", 150, 113, box, SIZE, True)
    monkeypatch.setattr(jpeg, "decoder", lambda: None)
    monkeypatch.setattr(jpeg, "window_decoder", lambda: None)  # no tensor decoder at all
    assert not tensor_decodable(open_lazy(data, "m"), 150, 113, box)
    assert torch.equal(decode_box(data, "m", 150, 113, box, SIZE, True), ours)


def test_the_file_path_gives_the_same_pixels_and_error_line(tmp_path: Path, monkeypatch) -> None:
    """load_box on a list of files (the per-file ImageFolder path): the tensor decode reads the file
    PIL opened; a bad file is the same BadInput line naming it."""
    good, grey, bad = tmp_path / "a.jpg", tmp_path / "b.jpg", tmp_path / "c.jpg"
    good.write_bytes(encode(photo(150, 113)))
    grey.write_bytes(encode(photo(113, 150), "L"))
    bad.write_bytes(bogus_huffman(good.read_bytes()))
    files = [str(good), str(grey), str(bad)]

    def box_of(w: int, h: int) -> tuple[int, int, int, int]:
        return (w // 7, h // 9, w // 2, h // 2)

    new = [load_box(files, i, box_of, SIZE, i == 1) for i in range(2)]
    with pytest.raises(BadInput) as new_err:
        load_box(files, 2, box_of, SIZE, False)
    monkeypatch.setattr(jpeg, "decoder", lambda: None)  # the PIL path, as before
    monkeypatch.setattr(jpeg, "window_decoder", lambda: None)
    old = [load_box(files, i, box_of, SIZE, i == 1) for i in range(2)]
    with pytest.raises(BadInput) as old_err:
        load_box(files, 2, box_of, SIZE, False)
    for (a, box_a), (b, box_b) in zip(new, old, strict=True):
        assert box_a == box_b and torch.equal(a, b)
    assert str(new_err.value) == str(old_err.value)
    assert str(new_err.value).startswith(f"data error: cannot decode image {bad}")


def test_plain_headers_are_the_ones_pil_opens_as_rgb_or_grey_at_that_size() -> None:
    """jpeg.plain_size lets a JPEG skip Image.open: only when PIL would open it, as RGB or L, at the
    size it says, within the bomb limit. Encoder variants, then random damage to the header bytes."""
    arr = photo(53, 37)
    plain = [
        encode(arr, **kw) for kw in ({"quality": 90}, {"progressive": True}, {"subsampling": 0}, {"comment": b"c"})
    ]
    plain.append(encode(arr, "L"))
    other = [
        encode(arr, "CMYK"),
        encode(arr, exif=b"Exif\x00\x00II*\x00"),
        encode(arr, icc_profile=b"\x00" * 200),
        encode(arr, fmt="PNG"),
    ]
    assert all(jpeg.plain_size(b) == (53, 37) for b in plain)
    assert all(jpeg.plain_size(b) is None for b in other)
    rng = np.random.default_rng(0)
    accepted = 0
    for t in range(4000):
        data = bytearray(plain[t % len(plain)])
        header = data.index(b"\xff\xda") + 12
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, header))
            data[at] = int(rng.integers(0, 256)) if rng.random() < 0.7 else data[at] ^ (1 << int(rng.integers(0, 8)))
        damaged = bytes(data[: int(rng.integers(0, len(data)))] if rng.random() < 0.1 else data)
        size = jpeg.plain_size(damaged)
        if size is None:
            continue
        accepted += 1
        with Image.open(io.BytesIO(damaged)) as im:
            assert (im.format, im.mode in ("RGB", "L"), im.size) == ("JPEG", True, size), damaged[:64]
    assert accepted > 1000


def test_damaged_data_the_tensor_decoder_reads_is_what_pil_reads() -> None:
    """Corrupt scan data under a plain header: whatever the tensor decoder returns, PIL returns too,
    pixel for pixel; what it refuses goes to PIL (decode_box), which decodes or names the error as
    before. (libjpeg-turbo's warnings on such data reach stderr through torchvision; PIL's do not.)"""
    rng = np.random.default_rng(1)
    seeds = [encode(photo(40, 30, s), **kw) for s, kw in enumerate(({"quality": 90}, {"progressive": True}))]
    seeds.append(encode(photo(40, 30), "L"))
    decoded = 0
    for t in range(600):
        data = bytearray(seeds[t % len(seeds)])
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(2, len(data)))
            data[at] = int(rng.integers(0, 256))
        damaged = bytes(data)
        if jpeg.plain_size(damaged) is None:
            continue
        ours = jpeg.decode_rgb(damaged)
        if ours is None:
            continue
        with Image.open(io.BytesIO(damaged)) as im:
            assert np.array_equal(np.asarray(im.convert("RGB")), ours.numpy())
        decoded += 1
    assert decoded > 100
