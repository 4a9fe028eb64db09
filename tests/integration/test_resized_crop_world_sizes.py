"""test_resized_crop_world_sizes: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_resized_crop.py.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from tests.unit.test_resized_crop import _traced_epoch, write_jpegs
from torchlaunch.config import DataConfig
from torchlaunch.worker.data import load_bundle


def test_same_sample_same_box_on_any_world_size_and_worker_count(tmp_path: Path) -> None:
    write_jpegs(tmp_path / "imgs", per_class=14)  # 42 images: 38 train, 3 steps of 12
    cfg = DataConfig(
        name="imagefolder",
        root=str(tmp_path / "imgs"),
        cache_dir=str(tmp_path / "c"),
        image_size=24,
        train_crop="resized",
    )
    bundle = load_bundle(cfg)
    assert bundle.train.images is None  # auto + resized: the files, not the squashed cache
    reference, _ = _traced_epoch(bundle, 1, 0)
    assert len(reference) == 3
    for world, workers in ((2, 1), (3, 0), (4, 3)):
        assert _traced_epoch(bundle, world, workers)[0] == reference
    sizes = {}
    for f in bundle.train.files:
        with Image.open(f) as im:
            sizes[f] = im.size
    boxes = [b for step in reference.values() for b in step[1]]
    assert len({tuple(b) for b in boxes}) > 1  # boxes vary, and each lies inside its own image
    for step in reference.values():
        for i, (left, top, w, h) in zip(step[0], step[1], strict=True):
            width, height = sizes[bundle.train.files[i]]
            assert left + w <= width and top + h <= height
