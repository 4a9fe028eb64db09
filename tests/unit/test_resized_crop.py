"""The ImageNet recipe's crops (issue 27): RandomResizedCrop boxes drawn per global step, resolved from
the image's own size in DataLoader workers, and the evaluation's resize + centre crop, on the per-file
ImageFolder path (original-aspect JPEGs of mixed sizes, never squashed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchlaunch.config import ConfigError
from torchlaunch.core.sampler import RESIZED_ATTEMPTS, BatchPlan
from torchlaunch.worker.data import ImageSet, Normalizer, TrainLoader, eval_batches
from torchlaunch.worker.data.augment import centre_box, resized_crop_box, val_resize_for

SIZES = [(120, 80), (64, 64), (50, 140), (200, 90), (33, 47), (96, 128)]


def write_jpegs(root: Path, classes: int = 3, per_class: int = 8, seed: int = 0) -> list[Path]:
    """Class folders of JPEGs of mixed sizes and aspect ratios (a grayscale one among them)."""
    rng = np.random.default_rng(seed)
    written = []
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = SIZES[(c * per_class + i) % len(SIZES)]
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            im = Image.fromarray(pixels).convert("L") if i == 3 else Image.fromarray(pixels)
            path = root / f"c{c}" / f"{i:03d}.jpg"
            im.save(path, quality=90)
            written.append(path)
    return written


def test_box_lies_inside_the_image_with_the_recipes_scale_and_ratio() -> None:
    g = torch.Generator().manual_seed(0)
    for width, height in [(500, 375), (64, 64), (30, 400), (1000, 20)]:
        for _ in range(200):
            v = torch.rand(RESIZED_ATTEMPTS, 4, generator=g, dtype=torch.float64).tolist()
            left, top, w, h = resized_crop_box(v, width, height)
            assert 0 <= left and 0 <= top and 0 < w and 0 < h and left + w <= width and top + h <= height
            assert resized_crop_box(v, width, height) == (left, top, w, h)  # a pure function
            if 0.75 <= width / height <= 4 / 3 and (w, h) != (width, height):  # an accepted attempt
                assert 0.08 * width * height * 0.8 <= w * h <= width * height
                assert 0.75 * 0.9 <= w / h <= 4 / 3 * 1.1


def test_box_falls_back_to_torchvisions_centre_crop() -> None:
    never_fits = [[1.0 - 1e-12, 0.0, 0.5, 0.5]] * RESIZED_ATTEMPTS  # full area at ratio 3/4: too tall for 1000x20
    assert resized_crop_box(never_fits, 1000, 20) == ((1000 - round(20 * 4 / 3)) // 2, 0, round(20 * 4 / 3), 20)
    assert resized_crop_box(never_fits, 20, 1000)[2:] == (20, round(20 / 0.75))


def test_variates_are_drawn_per_global_step_independent_of_world_size() -> None:
    plans = [BatchPlan(48, 12, 5, r, w, train_crop="resized") for w in (2, 3) for r in range(w)]
    perm = plans[0].permutation(1)
    full = plans[0].global_augmentation(1, 2, plans[0].step_indices(perm, 2))
    assert full[0].shape == (12, RESIZED_ATTEMPTS, 4) and full[1].shape == (12,)
    for w in (2, 3):
        parts = [p.rank_step(perm, 1, 2) for p in plans if p.world_size == w]
        assert torch.equal(torch.cat([a[0] for _, a in parts]), full[0])
        assert torch.equal(torch.cat([a[1] for _, a in parts]), full[1])
    pad = BatchPlan(48, 12, 5).global_augmentation(1, 2, plans[0].step_indices(perm, 2))
    assert torch.equal(pad[2], full[1])  # the flips are the pad recipe's draws: one flip stream


def test_val_resize_default_and_centre_box() -> None:
    assert val_resize_for(224, 0, "resized") == 256 and val_resize_for(224, 0, "pad") == 0
    assert val_resize_for(32, 40, "pad") == 40
    left, top, w, h = centre_box(500, 375, 224, 256)
    assert math.isclose(w, 224 * 375 / 256) and math.isclose(left, (500 - w) / 2) and math.isclose(top, (375 - h) / 2)


def _traced_epoch(bundle, world: int, workers: int, steps: int = 3) -> tuple[dict, torch.Tensor]:
    """Every rank's (indices, boxes, flips) per step, concatenated in rank order, and one batch."""
    out: dict[int, list] = {}
    first = None
    for rank in range(world):
        plan = BatchPlan(len(bundle.train), 12, 3, rank, world, train_crop="resized", image_size=24)
        norm = Normalizer(bundle.mean, bundle.std, torch.device("cpu"), False)
        loader = TrainLoader(bundle.train, plan, norm, torch.device("cpu"), True, workers, 24, trace=True)
        perm = plan.permutation(0)
        for step, micro in loader.epoch(0, 0):
            if step >= steps:
                break
            first = micro[0][0] if first is None else first
            assert micro[0][0].shape == (12 // world, 3, 24, 24)
            idx = plan.rank_step(perm, 0, step)[0].tolist()
            out.setdefault(step, []).append((idx, loader.step_trace["box"], loader.step_trace["flip"]))
    return {s: [sum((list(p[k]) for p in parts), []) for k in range(3)] for s, parts in out.items()}, first


def test_in_memory_training_set_refuses_the_resized_crop() -> None:
    images = ImageSet(labels=torch.zeros(24, dtype=torch.int64), images=torch.zeros(24, 3, 8, 8, dtype=torch.uint8))
    plan = BatchPlan(24, 12, 0, train_crop="resized", image_size=8)
    norm = Normalizer((0.5,) * 3, (0.5,) * 3, torch.device("cpu"), False)
    with pytest.raises(ConfigError, match="data.train_crop"):
        TrainLoader(images, plan, norm, torch.device("cpu"), True, 0, 8)


def test_evaluation_resizes_the_shorter_side_and_centre_crops(tmp_path: Path) -> None:
    """val_resize matches torchvision's Resize(R) + CenterCrop(S) on the same file (one resampling of
    the same region instead of two: close, not equal)."""
    tv = pytest.importorskip("torchvision.transforms.v2")
    path = tmp_path / "a" / "x.jpg"
    path.parent.mkdir()
    y, x = np.mgrid[0:90, 0:150]
    Image.fromarray(np.stack([x * 1.7, y * 2.8, (x + y)], -1).astype(np.uint8)).save(path, quality=95)
    data = ImageSet(labels=torch.zeros(1, dtype=torch.int64), files=[str(path)])
    norm = Normalizer((0.0,) * 3, (1 / 255,) * 3, torch.device("cpu"), False)  # identity on 0..255
    ((ours, _),) = list(eval_batches(data, 0, 1, 4, norm, torch.device("cpu"), 56, 0, val_resize=64))
    with Image.open(path) as im:
        ref = tv.Compose([tv.Resize(64), tv.CenterCrop(56), tv.PILToTensor()])(im.convert("RGB"))
    assert ours.shape == (1, 3, 56, 56)
    assert (ours[0] - ref.float()).abs().mean() < 3.0  # a smooth gradient: the same view to within rounding


def test_training_crop_is_torchvisions_crop_then_resize_and_close_to_pils() -> None:
    """A whole-pixel box of a full-scale decode goes through crop_resize_tensor: the same pixels as
    torchvision's tensor resized_crop (crop, then antialiased bilinear resize) of the same box, mirrored
    when asked; and within rounding of PIL's resize over that box (the kernel the fast path replaced)."""
    tvf = pytest.importorskip("torchvision.transforms.v2.functional")
    from torchlaunch.worker.data.augment import crop_resize

    y, x = np.mgrid[0:150, 0:200]
    smooth = np.stack([x * 1.2, y * 1.6, (x + y) * 0.7], -1).astype(np.uint8)
    im = Image.fromarray(smooth)
    tensor = torch.from_numpy(smooth).permute(2, 0, 1)
    for box, flip in (((10, 20, 120, 90), False), ((0, 0, 200, 150), True), ((37, 5, 41, 60), False)):
        ours = crop_resize(im, 200, 150, box, 56, flip)
        left, top, w, h = box
        ref = tvf.resized_crop(tensor, top, left, h, w, [56, 56], antialias=True)
        ref = ref.flip(-1) if flip else ref
        assert ours.dtype == torch.uint8 and ours.shape == (3, 56, 56)
        assert (ours.int() - ref.int()).abs().max() <= 1  # the mirror before the resize: rounding only
        pil = np.asarray(im.resize((56, 56), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)))
        pil = pil[:, ::-1] if flip else pil
        assert np.abs(ours.permute(1, 2, 0).numpy().astype(int) - pil.astype(int)).mean() < 1.0
        assert torch.equal(crop_resize(im, 200, 150, box, 56, flip), ours)  # a pure function of (box, flip)
