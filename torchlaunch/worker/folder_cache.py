"""The decode cache of an image folder, without torch: scan, fingerprint, decode once, publish.

Why a module of its own: a worker's start-up is mostly importing torch (and torchvision), ~1-2 s of
one core. The decode of a cold folder needs only PIL and numpy, so the worker starts it in a child
process (`python -m train.folder_cache`) before importing torch, on the other core, and loads the
published cache when its imports are done (torchlaunch/worker/run.py). Anything the child cannot do (a
corrupt file, no space) it leaves undone; the worker then decodes itself and reports the error as
it always did. The child also prints what the worker needs of a cached folder (its fingerprint, classes
and per-class counts), so the worker skips its own scan of every file (~0.2 s for 50,000 images).
Publishing is atomic (a temporary folder renamed into place), so a reader never sees a half-written
cache, and whichever of several writers finishes first wins.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash
from PIL import Image, UnidentifiedImageError

from torchlaunch import contract
from torchlaunch.base.untrusted import quote
from torchlaunch.config import DataConfig
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, BadInput

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp", ".tif", ".tiff")
DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError)
"""What a file that is not a usable image raises in PIL: the file is named, exit 2. A decompression
bomb (more pixels than PIL's limit, Image.MAX_IMAGE_PIXELS x 2) is refused when it is opened."""


def decode_error(path: str, e: BaseException) -> BadInput:
    if isinstance(e, Image.DecompressionBombError):
        return BadInput(
            f"data error: image {path} is too large to decode ({str(e).split(' could be')[0].rstrip(',')}: a decompression "
            "bomb?) (delete or replace that file)"
        )
    return BadInput(f"data error: cannot decode image {path}: {e} (delete or replace that file)")


def _regular_image(path: Path) -> None:
    """BadInput unless `path` is (or links to) a regular file: a FIFO, device or symlink loop there."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
        why = "a FIFO, socket or device"
    except OSError as e:
        regular, why = False, e.strerror or "unreadable"
    if not regular:
        raise BadInput(f"data error: {path} is not an image file ({why}); remove it from the image folder")


def scan_imagefolder(root: Path) -> tuple[list[str], list[str], list[int]]:
    """Class folders -> (classes, files, labels), sorted so every rank sees the same order."""
    if not root.is_dir():
        raise BadInput(
            f"data error: data.root {root} does not exist or is not a folder "
            f"(point data.root at a folder of class folders, e.g. train/<class>/<image>.jpg)"
        )
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise BadInput(
            f"data error: {root} has no class folders (expected {root}/<class>/<image>.jpg; "
            f"point data.root at the folder that holds the class folders)"
        )
    refuse_split_folders(root, classes)
    for name in classes:
        _utf8_name(root / name)
    files: list[str] = []
    labels: list[int] = []
    empty: list[str] = []
    for label, name in enumerate(classes):
        before = len(files)
        for dirpath, dirnames, filenames in os.walk(root / name):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.lower().endswith(IMAGE_EXTENSIONS):
                    _regular_image(Path(dirpath, fn))  # a FIFO would block its decoder forever
                    files.append(_utf8_name(Path(dirpath, fn)))
                    labels.append(label)
        if len(files) == before:
            empty.append(name)
    if not files:
        raise BadInput(
            f"data error: {root} has class folders but no images with extensions "
            f"{', '.join(IMAGE_EXTENSIONS)} (copy images into {root}/<class>/)"
        )
    if empty:
        raise BadInput(
            f"data error: class folder {root / empty[0]} has no images"
            f"{f' (and {len(empty) - 1} more: {empty[1:4]})' if len(empty) > 1 else ''}: a class the model "
            f"would learn from no sample (add images to it, or remove the folder)"
        )
    return classes, files, labels


SPLIT_NAMES = frozenset({"train", "val", "valid", "validation", "test"})
"""Folder names of a dataset's splits: a root holding only these is a split layout, not classes."""


def refuse_split_folders(root: Path, classes: list[str]) -> None:
    """`root/train/` and `root/val/` read as class folders would train a 2-class "train vs val" model
    that reaches high accuracy on nothing: one line pointing at the split to train on instead."""
    if "train" not in classes or len(classes) < 2 or not set(classes) <= SPLIT_NAMES:
        return
    others = [c for c in classes if c != "train"]
    raise BadInput(
        f"data error: {quote(str(root))} holds the splits train/ and {', '.join(c + '/' for c in others)}, not "
        f"class folders: it would train a {len(classes)}-class model telling the splits apart (point data.root at "
        f"{quote(str(root / 'train'))}; data.val_fraction holds out the validation images from it, and "
        f"python -m train.evaluate --data-root {quote(str(root / others[0]))} scores the {others[0]}/ split)"
    )


def _utf8_name(path: Path) -> str:
    """The path as text, refused when the name is not UTF-8 (it would break the cache key, the logs and
    the evaluation report, which all write file names as UTF-8)."""
    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = ascii(os.fsencode(path.name))
        raise BadInput(
            f"data error: the file name {shown} in {ascii(str(path.parent))} is not UTF-8 (rename it, e.g. with "
            "`convmv -f latin1 -t utf8`, or remove it)"
        ) from None
    return text


def images_checksum(images: np.ndarray) -> str:
    """Content checksum of a decoded folder (xxh3_128 of its bytes, ~20 GB/s): the cache is used only
    when it still holds what was decoded, never same-shape garbage written over it."""
    return "xxh3_128:" + xxhash.xxh3_128(np.ascontiguousarray(images).data).hexdigest()


def folder_fingerprint(root: Path, files: list[str]) -> str:
    """Cheap content key: relative paths, sizes and modification times of every image. Computed at every
    start, so kept lean: paths under `root` (all of scan_imagefolder's) lose the prefix by slicing rather
    than os.path.relpath (half the time for 50,000 files), with the same key either way."""
    h = hashlib.sha256()
    prefix = os.path.join(str(root), "")
    lines: list[str] = []
    for f in files:
        st = os.stat(f)
        rel = f[len(prefix) :] if f.startswith(prefix) else os.path.relpath(f, root)
        lines.append(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n")
        if len(lines) == 4096:
            h.update("".join(lines).encode())
            lines.clear()
    h.update("".join(lines).encode())
    return h.hexdigest()[:24]


def cache_images_file(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"imagefolder-{key}" / "images.npy"


def decode_all(files: list[str], size: int) -> np.ndarray | None:
    """Every image decoded into one uint8 (N, 3, size, size) array in a single pass (size check and
    pixels from one open per file: ~1/3 faster than a header pass, then a decode pass, then a stack);
    None at the first image that is not size x size. Pixels equal torchlaunch.worker.data.decode_image's."""
    out = np.empty((len(files), 3, size, size), dtype=np.uint8)
    for i, f in enumerate(files):
        try:
            with Image.open(f) as im:
                if im.size != (size, size):
                    return None
                rgb = im if im.mode == "RGB" else im.convert("RGB")
                out[i] = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
        except DECODE_ERRORS as e:
            raise decode_error(f, e) from None
    return out


def publish(images: np.ndarray, root: Path, cache_dir: Path, key: str) -> np.ndarray:
    """Store the decoded folder on disk under its fingerprint, atomically: the next run (or the other
    ranks of this one) loads it instead of decoding every file again."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".imagefolder-{key}."))
    except OSError as e:
        what = "a file, not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or e
        raise BadInput(
            f"data error: data.cache_dir {cache_dir} cannot be written: {what} (point data.cache_dir at a "
            "writable folder, e.g. data.cache_dir=~/.cache/torchlaunch, or use data.loader=pil)"
        ) from None
    try:
        np.save(tmp / "images.npy", images, allow_pickle=False)
        meta = {"root": str(root), "count": len(images), "shape": list(images.shape)}
        (tmp / "meta.json").write_text(json.dumps({**meta, "checksum": images_checksum(images)}))
        try:
            os.rename(tmp, cache_dir / f"imagefolder-{key}")
        except OSError:  # another node or rank published the same cache first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return images


@dataclass(frozen=True)
class FolderIndex:
    """A scanned folder whose decode cache exists: enough for the tensor path without a second scan (files
    are scanned class by class, so the labels are each class's index repeated `counts[i]` times)."""

    root: str
    cache_dir: str
    key: str
    classes: list[str]
    counts: list[int]


_prefetched: dict[tuple[str, str], FolderIndex] = {}
"""What a finished prefetch reported, by (root, cache_dir), until the worker's data loading takes it."""


def prepare(root: Path, cache_dir: Path, size: int) -> FolderIndex | None:
    """Make sure the cache for `root` exists; None when the folder is not for the tensor path
    (images of another size). Raises BadInput like the worker would."""
    classes, files, labels = scan_imagefolder(root)
    key = folder_fingerprint(root, files)
    if not cache_images_file(cache_dir, key).is_file():
        images = decode_all(files, size)
        if images is None:
            return None
        publish(images, root, cache_dir, key)
    counts = [labels.count(i) for i in range(len(classes))]
    return FolderIndex(str(root), str(cache_dir), key, classes, counts)


def take_prefetched(root: Path, cache_dir: Path) -> FolderIndex | None:
    """The index this process's prefetch reported for (root, cache_dir), once (a later load scans anew)."""
    return _prefetched.pop((str(root), str(cache_dir)), None)


def start_prefetch(data: DataConfig, env: Mapping[str, str] | None = None) -> subprocess.Popen | None:
    """Start decoding the configured image folder in a child process, if this worker is the one that
    builds the cache (local rank 0) and the folder may go through the tensor path. Call before
    importing torch; `finish_prefetch` before loading the data."""
    env = os.environ if env is None else env
    resized = data.train_crop == "resized" and data.loader == "auto"  # reads the files, never the cache
    if data.name != "imagefolder" or data.loader not in ("auto", "tensor") or resized or contract.local_rank(env) != 0:
        return None
    argv = [sys.executable, "-m", "torchlaunch.worker.folder_cache", data.root, data.cache_dir, str(data.image_size)]
    try:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
    except OSError:
        return None  # the worker decodes itself


def finish_prefetch(child: subprocess.Popen | None, wait: bool = True) -> None:
    """Wait for the prefetch and keep the index it printed for take_prefetched (it never raises: the
    worker checks and reports the data itself), or, with wait=False, stop it: the worker is leaving early."""
    if child is None or child.returncode is not None:
        return
    if not wait:
        child.terminate()
    try:
        out, _ = child.communicate()
    except KeyboardInterrupt:
        child.kill()
        raise
    if wait and child.returncode == 0:
        try:
            index = FolderIndex(**json.loads(out))
        except (ValueError, TypeError):
            return  # the worker scans the folder itself
        _prefetched[(index.root, index.cache_dir)] = index


def main(argv: list[str] | None = None) -> int:
    """The start-up prefetch: prints the folder's index as JSON for the worker, and nothing else (the
    worker, not this child, reports any problem)."""
    p = argparse.ArgumentParser(prog="python -m torchlaunch.worker.folder_cache", description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path)
    p.add_argument("cache_dir", type=Path)
    p.add_argument("size", type=int)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: publish() removes its temp folder
    try:
        index = prepare(args.root.expanduser(), args.cache_dir.expanduser(), args.size)
    except (BadInput, OSError, Image.DecompressionBombError):
        return BAD_INPUT
    if index is None:
        return FAILURE
    print(json.dumps(asdict(index)))
    return OK


if __name__ == "__main__":
    sys.exit(main())
