"""Class folders on disk, read the one way every part of the project reads them (torch-free).

Why a module of its own, on the data floor: the shard writer (`python -m train.shards write`), the
launch side's pre-check and the built-in worker's readers all walk a class-folder tree and must agree
on what counts as a class, an image and an unusable file; none of them may import the worker.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import BadInput

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
