"""JPEG draft decoding on the resized-crop path: decode + crop + resize of generated 400-800 px JPEGs
with PIL's draft (the DCT-scaled decode the loaders ask for) vs a full decode, with the same
RandomResizedCrop boxes from the batch plan; prints the time ratio, whether every box is identical and
the mean pixel difference. Run: python -m bench.draft224 (in-process, one core; noisy on a loaded box)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import JpegImagePlugin

from bench.loader224 import write_jpegs
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.worker.data.augment import resized_crop_box
from torchlaunch.worker.data.loaders import load_box


def decode_all(files: list[str], variates, size: int, draft: bool) -> tuple[float, list]:
    real = JpegImagePlugin.JpegImageFile.draft
    if not draft:
        JpegImagePlugin.JpegImageFile.draft = lambda self, *a, **k: None
    try:
        start = time.perf_counter()
        out = [
            load_box(files, i, lambda w, h, i=i: resized_crop_box(variates[i].tolist(), w, h), size, False)
            for i in range(len(files))
        ]
        return time.perf_counter() - start, out
    finally:
        JpegImagePlugin.JpegImageFile.draft = real


def main() -> None:
    root = write_jpegs(Path(tempfile.gettempdir()) / "bench-draft-jpegs", 2, 40)
    files = sorted(str(p) for p in root.rglob("*.jpg"))
    variates = BatchPlan(len(files), len(files), 0, train_crop="resized").resized_variates(0, 0)
    for size in (224, 128):
        for _ in range(2):  # the second round is the one reported (files in the page cache)
            with_draft, a = decode_all(files, variates, size, True)
            full, b = decode_all(files, variates, size, False)
        same = all(x[1] == y[1] for x, y in zip(a, b, strict=True))
        diff = np.mean([(x[0].float() - y[0].float()).abs().mean().item() for x, y in zip(a, b, strict=True)])
        print(
            f"{size} px: draft {with_draft:.2f} s, full decode {full:.2f} s ({full / with_draft:.2f}x), "
            f"boxes identical: {same}, mean abs pixel difference {diff:.2f}/255"
        )


if __name__ == "__main__":
    main()
