"""Shard storage figures, one run: per-core decode of the candidate CPU decoders (which one
torchlaunch.data.shards.decode uses), opening a 1,281,167-sample set from its index, and the writer.

    python -m bench.shards            # ~30 s on 2 cores; --heavy: more images per decoder
    python -m bench.run --only shards

Decode: the same JPEGs (generated ~500x375 ImageNet-like photos-ish noise + smooth gradients, and the
shared CIFAR-10 32x32 ones), each decoded and RandomResizedCrop'd to 224 (torchvision's scale
0.08-1 / ratio 3/4-4/3, the same seeded boxes for every decoder), one thread, interleaved rounds.
PIL without draft is torchvision's reference way and the baseline. Open: a synthetic set of 1,000
shards (sparse empty files of the indexed sizes; the index is the part that grows with the set)
opened in a fresh process: wall seconds and the RSS the open added. Writer: images/s of
`write` on the CIFAR subset (byte copy) and on the 500x375 JPEGs with --max-side 256 (re-encode),
against a plain tarfile of the same files.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import REPO, Result, median, median_ratio, paired_rates, shared_tarball
from torchlaunch.data.shards import decode
from torchlaunch.data.shards.index import ShardInfo, pack
from torchlaunch.data.shards.writer import write

CROP = 224
N_SAMPLES = 1_281_167
N_SHARDS = 1000


def imagenet_like(n: int, seed: int = 0) -> list[bytes]:
    """~500x375 JPEGs (quality 90) with smooth structure plus noise, so they compress like photos
    (~60-120 KB) rather than like pure noise."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w, h = (500, 375) if rng.random() < 0.7 else (375, 500)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([np.sin(xx / rng.uniform(8, 40) + c) * np.cos(yy / rng.uniform(8, 40)) for c in range(3)], -1)
        arr = np.clip(128 + 90 * base + rng.normal(0, 18, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def cifar_jpegs(n: int) -> list[bytes]:
    tarball = shared_tarball()
    if tarball is None:
        return imagenet_like(0)
    out = []
    with tarfile.open(tarball) as tf:
        for m in tf:
            if m.isfile() and m.name.endswith(".jpg"):
                out.append(tf.extractfile(m).read())
                if len(out) == n:
                    break
    return out


def rrc_box(w: int, h: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (10 tries, then the centre fallback)."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return x, y, cw, ch
    s = min(w, h)
    return (w - s) // 2, (h - s) // 2, s, s


def boxes_for(images: list[bytes], seed: int) -> list[tuple[int, int, int, int]]:
    rng = np.random.default_rng(seed)
    return [rrc_box(*Image.open(io.BytesIO(b)).size, rng) for b in images]


def pil_side(images: list[bytes], boxes, draft: bool):
    def one() -> float:
        start = time.process_time()
        for data, (x, y, cw, ch) in zip(images, boxes, strict=True):
            if draft:
                w, h = Image.open(io.BytesIO(data)).size
                s = min(cw / CROP, ch / CROP)
                im = decode(data, "bench", draft_to=(math.ceil(w / s), math.ceil(h / s)) if s > 1 else None)
                fx, fy = im.size[0] / w, im.size[1] / h
                box = (x * fx, y * fy, (x + cw) * fx, (y + ch) * fy)
            else:
                im = decode(data, "bench")
                box = (x, y, x + cw, y + ch)
            im.resize((CROP, CROP), Image.Resampling.BILINEAR, box=box)
        return len(images) / (time.process_time() - start)

    return one


def project_side(images: list[bytes], boxes):
    """The shard loader's own per-sample work (boxes.decode_box, what load_box runs on a shard): an RGB or
    grey JPEG at full scale is decoded to a tensor by libjpeg-turbo (torchvision's image extension; a
    plain header without PIL's Image.open), anything else by PIL with the draft the box allows; then
    the crop and torch's resize, to a uint8 tensor. Sizes come from the index in the loader, so they
    are read outside the timing."""
    from torchlaunch.worker.data.boxes import decode_box

    sizes = [Image.open(io.BytesIO(b)).size for b in images]

    def one() -> float:
        start = time.process_time()
        for data, (w, h), box in zip(images, sizes, boxes, strict=True):
            decode_box(data, "bench", w, h, box, CROP, False)
        return len(images) / (time.process_time() - start)

    return one


def project_pil_side(images: list[bytes], boxes):
    """The loader's path before the tensor decode (and still its path without torchvision's image
    extension): shards.decode with the draft the box allows, then augment.crop_resize."""
    from torchlaunch.worker.data.augment import crop_resize, draft_request

    sizes = [Image.open(io.BytesIO(b)).size for b in images]

    def one() -> float:
        start = time.process_time()
        for data, (w, h), box in zip(images, sizes, boxes, strict=True):
            im = decode(data, "bench", draft_to=draft_request(w, h, box[2], box[3], CROP))
            crop_resize(im, w, h, box, CROP, False)
        return len(images) / (time.process_time() - start)

    return one


def simplejpeg_side(images: list[bytes], boxes, draft: bool):
    import simplejpeg

    def one() -> float:
        start = time.process_time()
        for data, (x, y, cw, ch) in zip(images, boxes, strict=True):
            w, h = simplejpeg.decode_jpeg_header(data)[:2][::-1]
            s = min(cw / CROP, ch / CROP)
            kw = {"min_width": math.ceil(w / s), "min_height": math.ceil(h / s)} if draft and s > 1 else {}
            arr = simplejpeg.decode_jpeg(data, colorspace="RGB", **kw)
            fx, fy = arr.shape[1] / w, arr.shape[0] / h
            Image.fromarray(arr).resize(
                (CROP, CROP), Image.Resampling.BILINEAR, box=(x * fx, y * fy, (x + cw) * fx, (y + ch) * fy)
            )
        return len(images) / (time.process_time() - start)

    return one


def torchvision_side(images: list[bytes], boxes):
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2.functional import resized_crop

    torch.set_num_threads(1)
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in images]

    def one() -> float:
        start = time.process_time()
        for data, (x, y, cw, ch) in zip(tensors, boxes, strict=True):
            img = decode_jpeg(data, mode=ImageReadMode.RGB)
            resized_crop(img, y, x, ch, cw, [CROP, CROP], antialias=True)
        return len(images) / (time.process_time() - start)

    return one


def measure_decode(images: list[bytes], label: str, rounds: int) -> dict[str, list[float]]:
    boxes = boxes_for(images, 1)
    sides = {
        "pil": pil_side(images, boxes, False),
        "pil_draft": pil_side(images, boxes, True),
        "project": project_side(images, boxes),
        "project_pil": project_pil_side(images, boxes),
    }
    try:
        import simplejpeg  # noqa: F401

        sides["simplejpeg"] = simplejpeg_side(images, boxes, False)
        sides["simplejpeg_scaled"] = simplejpeg_side(images, boxes, True)
    except ImportError:
        pass
    sides["torchvision"] = torchvision_side(images, boxes)
    return paired_rates(sides, rounds=rounds)


OPEN_CHILD = """
import json, os, sys, time
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
import numpy, xxhash, PIL.Image
from torchlaunch.data.shards import ShardSet
before = rss(); t = time.perf_counter()
ss = ShardSet.open(sys.argv[1])
dt = time.perf_counter() - t
arrays = sum(a.nbytes for a in (ss.labels, ss.sizes, ss._offset, ss._nbytes, ss._xxh3, ss._ext))
print(json.dumps({"seconds": dt, "rss_added": rss() - before, "arrays": arrays, "n": len(ss)}))
"""


def synthetic_set(folder: Path, n: int, shards: int) -> Path:
    """A set folder of `shards` sparse shard files and a set index over n samples (no image bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    counts = np.full(shards, n // shards)
    counts[: n % shards] += 1
    nbytes = rng.integers(20_000, 200_000, n).astype("<u4")
    offset = np.zeros(n, "<u8")
    infos, at = [], 0
    for s, c in enumerate(counts):
        part = nbytes[at : at + c].astype(np.int64) + 1536
        offset[at : at + c] = 1024 + np.concatenate([[0], np.cumsum(part)[:-1]])
        size = int(1024 + part.sum() + 10240)
        name = f"train-{s:06d}.tar"
        with open(folder / name, "wb") as f:
            f.truncate(size)
        infos.append(ShardInfo(name, size, f"{s:016x}", int(c)))
        at += c
    w = rng.integers(200, 800, n)
    columns = {
        "offset": offset,
        "nbytes": nbytes,
        "label": rng.integers(0, 1000, n),
        "size": np.stack([w, (w * 0.75).astype(np.int64)], 1),
        "xxh3": rng.integers(0, 2**63, n, dtype=np.uint64),
        "ext": np.zeros(n, "u1"),
        "key": np.array([f"n{i % 1000:08d}_{i}".encode() for i in range(n)], dtype="S24"),
    }
    with open(folder / "shards.idx", "wb") as f:
        for part in pack("set", infos, columns):
            f.write(part)
    return folder


def measure_open(work: Path, n: int, shards: int, rounds: int = 3) -> dict:
    folder = synthetic_set(work / f"open-{n}", n, shards)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", OPEN_CHILD, str(folder)], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(rounds)
    ]
    return {
        "seconds": median([r["seconds"] for r in runs]),
        "rss_added": median([r["rss_added"] for r in runs]),
        "arrays": runs[0]["arrays"],
        "n": n,
    }


def class_folders(root: Path, images: list[bytes], classes: int = 10) -> Path:
    for i, data in enumerate(images):
        d = root / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:05d}.jpg").write_bytes(data)
    return root


def measure_writer(work: Path, cifar: list[bytes], big: list[bytes]) -> dict:
    out: dict = {}
    for label, images, max_side in (("copy", cifar, None), ("resize256", big, 256)):
        src = class_folders(work / f"src-{label}", images)
        start = time.perf_counter()
        write(src, work / f"out-{label}", max_side=max_side, shard_size_mb=64)
        out[label] = len(images) / (time.perf_counter() - start)
        start = time.perf_counter()
        with tarfile.open(work / f"plain-{label}.tar", "w") as tf:
            for p in sorted(src.rglob("*.jpg")):
                tf.add(p, arcname=p.name)
        out[f"plain_{label}"] = len(images) / (time.perf_counter() - start)
    return out


def run(quick: bool = False, work: Path | None = None, heavy: bool = False) -> list[Result]:
    import tempfile

    work = Path(work or tempfile.mkdtemp(prefix="bench-shards-")) / "shards"
    work.mkdir(parents=True, exist_ok=True)
    n_big = 12 if quick else (300 if heavy else 60)
    big = imagenet_like(n_big)
    cifar = cifar_jpegs(40 if quick else 600)
    rounds = 2 if quick else 5
    dec = measure_decode(big, "imagenet", rounds)
    dec_c = measure_decode(cifar, "cifar", rounds) if cifar else {}
    opened = measure_open(work, 20_000 if quick else N_SAMPLES, 20 if quick else N_SHARDS, rounds=1 if quick else 3)
    wr = measure_writer(work, cifar, big)
    med = {k: median(v) for k, v in dec.items()}
    best = max(med, key=med.get)
    ratio, per_round = median_ratio(dec["project"], dec["pil"])
    draft_ratio, _ = median_ratio(dec["pil_draft"], dec["pil"])
    tensor_ratio, tensor_rounds = median_ratio(dec["project"], dec["project_pil"])
    cmd = "python -m bench.run --only shards"
    decode_notes = (
        f"per core, one thread, {len(big)} ~500x375 JPEGs (q90, mean {np.mean([len(b) for b in big]) / 1e3:.0f} KB), "
        f"decode + RandomResizedCrop to 224, {rounds} interleaved rounds, images per CPU-second of the one thread "
        "(the box is shared with other jobs: CPU time moves far less than wall time); medians: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in med.items())
        + f" (fastest: {best}). CIFAR-10 32x32: "
        + ", ".join(f"{k} {median(v):,.0f}" for k, v in dec_c.items())
        + f". PIL + draft alone ÷ PIL: {draft_ratio:.2f}. The loader's tensor decode ÷ its PIL path (project ÷ "
        f"project_pil): {tensor_ratio:.2f} (per round: {', '.join(f'{r:.2f}' for r in tensor_rounds)}). simplejpeg is "
        "not a project dependency (bench only); the loader decodes RGB and grey JPEGs at full scale with "
        "libjpeg-turbo straight to a tensor (torchvision's image extension, PIL's pixels exactly), anything else "
        "with PIL and the draft the box allows, and resizes with torch on the uint8 crop (see docs/data.md, Shard data)"
    )
    mb = opened["rss_added"] / 2**20
    return [
        Result(
            key="shards_decode",
            title="Shard decode + crop per core: the loader's (tensor JPEG decode or PIL draft, torch resize) ÷ PIL (torchvision's reference), RandomResizedCrop 224, ~500x375 JPEGs",
            project=med["project"],
            baseline=med["pil"],
            unit="images/s",
            ratio=ratio,
            goal=1.0,
            higher_is_better=True,
            command=cmd,
            project_label="boxes.decode_box: libjpeg-turbo to a tensor (else PIL with draft) + crop + torch resize -> uint8",
            baseline_label="PIL open + convert RGB + crop/resize (no draft)",
            rounds=per_round,
            notes=decode_notes,
            extra={
                "imagenet": med,
                "cifar": {k: median(v) for k, v in dec_c.items()},
                "tensor_decode_ratio": tensor_ratio,
            },
        ),
        Result(
            key="shards_open",
            title=f"Opening a {opened['n']:,}-sample shard set ({N_SHARDS if not quick else 20} shards) from its set index ÷ the 2 s budget",
            project=opened["seconds"],
            baseline=2.0,
            unit="s",
            ratio=opened["seconds"] / 2.0,
            goal=1.0,
            higher_is_better=False,
            command=cmd,
            project_label="ShardSet.open in a fresh process (median of 3)",
            baseline_label="the issue's budget",
            notes=f"RSS added by the open {mb:.0f} MB (budget 100 MB); index arrays held {opened['arrays'] / 2**20:.0f} MB; keys stay on disk until an error names one",
            extra=opened,
        ),
        Result(
            key="shards_writer",
            title="Shard writer images/s ÷ a plain tarfile of the same files (byte copy, CIFAR-10 JPEGs)",
            project=wr["copy"],
            baseline=wr["plain_copy"],
            unit="images/s",
            ratio=wr["copy"] / wr["plain_copy"],
            goal=0.25,
            higher_is_better=True,
            command=cmd,
            project_label="python -m train.shards write (tar + fsync + index + set index + manifest)",
            baseline_label="tarfile.add of the same files",
            notes=f"with --max-side 256 on the ~500x375 JPEGs (decode + resize + re-encode): {wr['resize256']:,.0f} images/s "
            f"(plain tar {wr['plain_resize256']:,.0f}); one process; the goal only says the writer's bookkeeping stays within 4x of a plain tar",
            extra=wr,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shards", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--heavy", action="store_true", help="300 ImageNet-like JPEGs per decoder instead of 60")
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args(argv)
    for r in run(quick=args.quick, work=args.work, heavy=args.heavy):
        print(json.dumps(r.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
