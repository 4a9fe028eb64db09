"""`python -m train.shards write`: class folders -> tar shards in the webdataset layout, indexed.

Deterministic: classes and files sorted (the project's ImageFolder scan), sample order a seeded
permutation per split (so every shard mixes classes), the number of samples per shard fixed before
any shard is written (from the source sizes, or from a seeded probe of the output when resizing),
and every tar header fixed (mtime 0, uid/gid 0, mode 0644, no user names, USTAR). The same input and
options give the same bytes.

Resumable: shard k is written to a temporary name, fsynced and renamed, and only then indexed (the
index is written durably too); a shard counts as done when its index is present, holds the planned
number of samples and matches the shard's size and checksum. A rerun skips the done shards and
rewrites the rest, so a crash never leaves a half shard indexed. Shards are independent, so
`workers` processes write them in parallel with the same bytes as one. The plan (sources, options) is kept
in DIR/.write-plan.json: a rerun with other inputs is refused rather than mixed in.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import multiprocessing as mp
import os
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from torchlaunch.base.files import read_json
from torchlaunch.base.storage import refusal
from torchlaunch.base.untrusted import quote
from torchlaunch.data.folders import decode_error, scan_imagefolder
from torchlaunch.data.shards.decode import to_rgb
from torchlaunch.data.shards.errors import ShardError
from torchlaunch.data.shards.fsio import fsync_dir
from torchlaunch.data.shards.index import SET_INDEX, index_path, load, matches, write_set_index, write_shard_index
from torchlaunch.data.shards.reader import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION
from torchlaunch.data.shards.record import WRITE_PLAN, read_sums, write_sums
from torchlaunch.exit_codes import BadInput
from torchlaunch.rundir import check_real_folder, write_json

PLAN = WRITE_PLAN
TAR_OVERHEAD = 2048
"""Bytes a sample adds beyond its image: two 512-byte headers, the .cls block, padding on average."""
PROBE = 32

Hook = Callable[[str, str], None]


@dataclass
class Split:
    name: str
    files: list[str]
    labels: list[int]


def source_fingerprint(root: Path, files: list[str]) -> str:
    """Relative paths and sizes of every source image (no mtimes: a copy of the same tree gives the same id)."""
    h = hashlib.sha256()
    prefix = os.path.join(str(root), "")
    for f in files:
        rel = f[len(prefix) :] if f.startswith(prefix) else f
        h.update(f"{rel}\0{os.stat(f).st_size}\n".encode())
    return h.hexdigest()[:24]


def encode(path: str, max_side: int | None, quality: int) -> tuple[bytes, str]:
    """A source image as stored: the file itself when it is a JPEG in L or RGB no longer than
    max_side, else decoded, resized (long side to max_side, aspect kept) and re-encoded as JPEG."""
    try:
        raw = Path(path).read_bytes()
        with Image.open(io.BytesIO(raw)) as im:
            w, h = im.size
            small = max_side is None or max(w, h) <= max_side
            if small and im.format == "JPEG" and im.mode in ("L", "RGB"):
                return raw, "jpg"
            im.load()
            rgb = to_rgb(im)
    except OSError as e:
        raise decode_error(path, e) from None
    except Exception as e:  # PIL raises SyntaxError, ValueError... for bad files
        raise decode_error(path, e) from None
    if not small:
        assert max_side is not None
        scale = max_side / max(w, h)
        rgb = rgb.resize(
            (max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS, reducing_gap=3.0
        )
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=quality)
    return out.getvalue(), "jpg"


def key_of(pos: int, path: str) -> str:
    stem = Path(path).name.split(".")[0]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)[:48]
    return f"{pos:08d}_{safe}" if safe else f"{pos:08d}"


def _info(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
    return ti


def write_tar(path: Path, members: list[tuple[str, bytes]], hook: Hook | None) -> None:
    """Write a tar atomically and durably (temp name, fsync, rename, folder fsync)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tf:
                for name, data in members:
                    tf.addfile(_info(name, len(data)), io.BytesIO(data))
                    if hook is not None:
                        hook("member", f"{path.name}/{name}")
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # a full disk: give the space back (a crash's temp file is removed by the rerun)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def per_shard(split: Split, order: np.ndarray, shard_bytes: int, max_side: int | None, quality: int) -> int:
    """Samples per shard, fixed before writing so shard boundaries depend only on inputs and options."""
    if not split.files:
        return 1
    sizes = np.array([os.stat(f).st_size for f in split.files], dtype=np.float64)
    mean = float(sizes.mean())
    if max_side is not None:  # probe: the output/source size ratio of a seeded few
        probe = [int(i) for i in order[:PROBE]]
        src = sum(sizes[i] for i in probe)
        out = sum(len(encode(split.files[i], max_side, quality)[0]) for i in probe)
        mean = mean * (out / src if src else 1.0)
    return max(1, int(shard_bytes // (mean + TAR_OVERHEAD)))


class Progress:
    """A tqdm bar on a terminal, a line every ~10 s otherwise (batch logs), both on stderr."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.start, self.last = total, done, time.monotonic(), time.monotonic()
        self.written = 0
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=done, unit="img", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def add(self, n: int) -> None:
        self.done += n
        self.written += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            print(f"shards: {self.done:,}/{self.total:,} images", file=sys.stderr, flush=True)

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.monotonic() - self.start


def plan_splits(
    src: Path, val_from: Path | None, val_fraction: float | None, split_seed: int
) -> tuple[list[str], list[Split], dict]:
    classes, files, labels = scan_imagefolder(src)
    source = {"train_from": str(src), "train_fingerprint": source_fingerprint(src, files)}
    if val_from is not None:
        vclasses, vfiles, vlabels = scan_imagefolder(val_from)
        if vclasses != classes:
            extra = sorted(set(vclasses) ^ set(classes))[:3]
            raise BadInput(
                f"shards error: --val-from {val_from} has other class folders than --from {src} ({', '.join(extra)}) (use folders with the same classes)"
            )
        source.update(val_from=str(val_from), val_fingerprint=source_fingerprint(val_from, vfiles))
        return classes, [Split("train", files, labels), Split("val", vfiles, vlabels)], source
    if val_fraction:
        rng = np.random.default_rng([split_seed, 104729])
        perm = rng.permutation(len(files))
        n_val = max(1, round(len(files) * val_fraction))
        val, train = sorted(perm[:n_val].tolist()), sorted(perm[n_val:].tolist())
        source["val_fraction"] = val_fraction
        return (
            classes,
            [
                Split("train", [files[i] for i in train], [labels[i] for i in train]),
                Split("val", [files[i] for i in val], [labels[i] for i in val]),
            ],
            source,
        )
    return classes, [Split("train", files, labels)], source


def write_one(job: tuple, hook: Hook | None = None) -> int:
    """Encode, write and index one shard; returns its sample count (runs in a pool process too)."""
    files, labels, positions, start, path, max_side, quality = job
    members = []
    for pos, i in enumerate(positions.tolist(), start):
        data, ext = encode(files[i], max_side, quality)
        key = key_of(pos, files[i])
        members += [(f"{key}.{ext}", data), (f"{key}.cls", str(labels[i]).encode())]
    index_path(path).unlink(missing_ok=True)  # the shard is incomplete from here until its new index
    write_tar(path, members, hook)
    write_shard_index(path)
    return len(positions)


def _done(path: Path, count: int, recorded: tuple[int, str] | None) -> bool:
    """Shard `path` is complete: indexed with the planned count, the index matching its bytes, and those
    bytes what this writer recorded when it wrote them (an index rebuilt over a changed shard does not
    make it done: the rerun is how a damaged shard is repaired)."""
    idx = index_path(path)
    if not (path.is_file() and idx.is_file()) or path.is_symlink() or idx.is_symlink():
        return False
    try:
        index = load(idx, "shard")
    except ShardError:
        return False
    info = index.shards[0]
    return len(index) == count and matches(index, path) and recorded in (None, (info.size, info.xxh3))


def _recorded(folder: Path) -> dict[str, tuple[int, str]]:
    """What an earlier run of this write recorded in `folder` ({} when nothing usable: rewritten then)."""
    try:
        return read_sums(folder)
    except ShardError:
        return {}


def refuse_nested(src: Path, out: Path, flag: str) -> None:
    """--out inside a source tree would be scanned as one of its classes on the next run."""
    inner, outer = out.resolve(), src.resolve()
    if inner == outer or outer in inner.parents:
        raise BadInput(
            f"shards error: --out {quote(str(out))} is {'' if inner == outer else 'inside '}{flag} "
            f"{quote(str(src))}, so its shards would "
            "become a class of the source (put --out outside the class folders)"
        )


def write(
    src: Path,
    out: Path,
    *,
    val_from: Path | None = None,
    val_fraction: float | None = None,
    max_side: int | None = None,
    quality: int = 90,
    shard_size_mb: float = 256,
    split_seed: int = 0,
    workers: int = 1,
    hook: Hook | None = None,
) -> dict:
    """Write (or finish writing) a shard set; returns the manifest. See the module docstring."""
    refuse_nested(src, out, "--from")
    if val_from is not None:
        refuse_nested(val_from, out, "--val-from")
    classes, splits, source = plan_splits(src, val_from, val_fraction, split_seed)
    options = {"max_side": max_side, "quality": quality, "shard_size_mb": shard_size_mb, "split_seed": split_seed}
    plan = {"source": source, "options": options, "classes": classes}
    for split in splits:  # the output is untrusted storage: no shard is written or deleted through a link
        check_real_folder(out / split.name, prefix="shards error: ", what="a split folder", fix="remove the link")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # whatever the errno (a file in the way, /proc, no permission): --out is the user's input
        raise refusal(e, out, prefix="shards error: ", what="--out") from None
    old, why = read_json(out / PLAN)
    if old is not None and old != plan:
        raise BadInput(
            f"shards error: {out} holds a write with other sources or options (use another --out, or delete {out})"
        )
    if old is None and why == "missing" and any(out.iterdir()):
        raise BadInput(
            f"shards error: {out} is not empty and was not written by this command (use an empty or new --out)"
        )
    write_json(out / PLAN, plan, durable=True)
    (out / MANIFEST).unlink(missing_ok=True)  # the set is unfinished until the new manifest: readers refuse it
    total = sum(len(s.files) for s in splits)
    layouts = []
    for i, split in enumerate(splits):
        order = np.random.default_rng([split_seed, 7919, i]).permutation(len(split.files))
        n = per_shard(split, order, int(shard_size_mb * (1 << 20)), max_side, quality)
        layouts.append((split, order, n))
    done_before = 0
    todo = []
    for split, order, n in layouts:
        folder = out / split.name
        folder.mkdir(exist_ok=True)
        recorded = _recorded(folder)
        for k, start in enumerate(range(0, len(order), n)):
            path = folder / f"{split.name}-{k:06d}.tar"
            count = min(n, len(order) - start)
            if _done(path, count, recorded.get(path.name)):
                done_before += count
            else:
                todo.append((split, order, path, start, count))
    progress = Progress(total, done_before)
    jobs = [
        (split.files, split.labels, order[start : start + count], start, path, max_side, quality)
        for split, order, path, start, count in todo
    ]
    if hook is not None or workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            progress.add(write_one(job, hook))
            if hook is not None:
                hook("shard", job[4].name)
    else:  # shards are independent (boundaries fixed up front): one per process, same bytes as serial
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ctx.Pool(min(workers, len(jobs))) as pool:
            for n in pool.imap_unordered(write_one, jobs):
                progress.add(n)
    seconds = progress.close()
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "classes": classes,
        "source": source,
        "options": options,
        "splits": {},
    }
    for split, order, n in layouts:
        folder = out / split.name
        names = [f"{split.name}-{k:06d}.tar" for k in range(len(range(0, len(order), n)))]
        for stale in sorted(set(p.name for p in folder.glob("*.tar")) - set(names)):
            (folder / stale).unlink()
            index_path(folder / stale).unlink(missing_ok=True)
        for tmp in folder.glob(".*.tmp"):
            tmp.unlink()
        parts = [load(index_path(folder / nm), "shard") for nm in names]
        write_set_index(folder, parts)
        write_sums(folder, [p.shards[0] for p in parts])
        manifest["splits"][split.name] = {"count": len(order), "shards": names, "index": SET_INDEX}
    write_json(out / MANIFEST, manifest, durable=True)
    rate = progress.written / seconds if seconds > 0 else 0.0
    print(
        f"shards: wrote {progress.written:,} images ({done_before:,} already done) in {seconds:.1f} s, "
        f"{rate:,.0f} images/s, to {out}",
        file=sys.stderr,
        flush=True,
    )
    return manifest
