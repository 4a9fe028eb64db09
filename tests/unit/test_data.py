"""train.data: the world-size-invariant batch plan, batched augmentation, eval sharding, image folders."""

from __future__ import annotations

import os
import pickle
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchlaunch.config import DataConfig
from torchlaunch.data import folders
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker import data as data_mod
from torchlaunch.worker import folder_cache
from torchlaunch.worker.data import BatchPlan, ImageSet, Normalizer, TrainLoader, augment, eval_shard
from torchlaunch.worker.data import imagefolder as imagefolder_reader  # the module that calls what is patched

# ------------------------------------------------------------------------------------------ helpers


def write_folder(root: Path, per_class: dict[str, int], size: int = 32, seed: int = 0) -> list[Path]:
    """A tiny ImageFolder of random PNGs (lossless, so decoded pixels are exactly what was written)."""
    rng = np.random.default_rng(seed)
    written = []
    for name, count in per_class.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            path = root / name / f"{i:04d}.png"
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
            written.append(path)
    return written


def folder_cfg(root: Path, cache: Path, **kw: object) -> DataConfig:
    return DataConfig(name="imagefolder", root=str(root), cache_dir=str(cache), **kw)


def one_line_bad_input(fn, *args) -> str:
    with pytest.raises(BadInput) as info:
        fn(*args)
    text = str(info.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------------------------ batch plan


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_rank_slices_make_up_the_global_batch_on_any_world_size(world: int) -> None:
    n, batch, seed = 1000, 64, 3
    reference = BatchPlan(n, batch, seed)  # one process: the global batch itself
    plans = [BatchPlan(n, batch, seed, rank=r, world_size=world) for r in range(world)]
    for epoch in (0, 1):
        perm = reference.permutation(epoch)
        for step in range(reference.steps_per_epoch):
            want_idx, want_aug = reference.rank_step(perm, epoch, step)
            parts = [p.rank_step(p.permutation(epoch), epoch, step) for p in plans]
            assert torch.equal(torch.cat([idx for idx, _ in parts]), want_idx)
            for k in range(3):  # dy, dx, flip: the same augmentation whatever the world size
                assert torch.equal(torch.cat([aug[k] for _, aug in parts]), want_aug[k])
            assert [len(idx) for idx, _ in parts] == list(plans[0].shares)


def test_shares_of_every_world_size_up_to_the_batch_concatenate_to_the_step() -> None:
    """W = 1..B ranks: the shares (which differ by at most one) put together are exactly the global
    step's indices and augmentation draws (crop, flip, cutout), in order."""
    n, batch, seed = 200, 64, 11
    reference = BatchPlan(n, batch, seed, cutout=3, image_size=8)
    perm = reference.permutation(1)
    steps = (0, reference.steps_per_epoch - 1)
    want = {s: reference.rank_step(perm, 1, s) for s in steps}
    for world in range(1, batch + 1):
        plans = [BatchPlan(n, batch, seed, r, world, cutout=3, image_size=8) for r in range(world)]
        shares = plans[0].shares
        assert sum(shares) == batch and max(shares) - min(shares) <= 1 and min(shares) >= 1
        assert [p.per_rank for p in plans] == list(shares)
        for s in steps:
            parts = [p.rank_step(perm, 1, s) for p in plans]
            assert torch.equal(torch.cat([idx for idx, _ in parts]), want[s][0]), (world, s)
            for k in range(len(want[s][1])):
                assert torch.equal(torch.cat([aug[k] for _, aug in parts]), want[s][1][k]), (world, s, k)


@pytest.mark.parametrize("micro", [0, 1, 2, 5, 16, 100])
def test_micro_steps_are_the_same_count_on_every_rank_and_differ_by_one(micro: int) -> None:
    """Every rank runs the same number of micro-steps (DDP syncs on the last); at each one the ranks'
    batches differ by at most one sample and fit micro; the last is never empty; the loss weights of
    all micro-batches of all ranks add up to W (so DDP's average is the global mean)."""
    batch = 37
    for world in (1, 2, 3, 5, 8, 37):
        plans = [BatchPlan(100, batch, 0, r, world, micro) for r in range(world)]
        sizes = [p.micro_sizes() for p in plans]
        assert len({len(z) for z in sizes}) == 1 and len(sizes[0]) == plans[0].accumulation
        assert [sum(z) for z in sizes] == list(plans[0].shares)
        for column in zip(*sizes, strict=True):
            assert max(column) - min(column) <= 1
            assert max(column) <= (micro or batch) and max(column) <= plans[0].micro
        assert all(z[-1] >= 1 for z in sizes)
        assert sum(p.loss_weight(m) for p, z in zip(plans, sizes, strict=True) for m in z) == world
    even = BatchPlan(100, 32, 0, 1, 2, 4)
    assert even.micro_sizes() == [4, 4, 4, 4] and even.loss_weight(4) == Fraction(1, 4)


def test_epoch_is_a_permutation_and_epochs_differ() -> None:
    plan = BatchPlan(257, 32, seed=0)
    p0, p1 = plan.permutation(0), plan.permutation(1)
    assert sorted(p0.tolist()) == list(range(257)) == sorted(p1.tolist())
    assert not torch.equal(p0, p1)
    assert torch.equal(p0, BatchPlan(257, 32, seed=0).permutation(0))  # a pure function of (seed, epoch)
    assert not torch.equal(p0, BatchPlan(257, 32, seed=1).permutation(0))
    assert plan.steps_per_epoch == 8  # the last partial batch is dropped
    a0, a1 = plan.global_augmentation(0, 0), plan.global_augmentation(1, 0)
    assert not all(torch.equal(x, y) for x, y in zip(a0, a1, strict=True))


def test_steps_of_an_epoch_do_not_overlap() -> None:
    plan = BatchPlan(100, 10, seed=5, rank=1, world_size=2)
    perm = plan.permutation(0)
    seen = torch.cat([plan.rank_step(perm, 0, s)[0] for s in range(plan.steps_per_epoch)])
    assert len(set(seen.tolist())) == len(seen) == 50


def synthetic_loader(plan: BatchPlan, n: int = 96) -> TrainLoader:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 8, 8), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), generator=g)
    norm = Normalizer((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), torch.device("cpu"), channels_last=False)
    return TrainLoader(
        ImageSet(labels=labels, images=images),
        plan,
        norm,
        torch.device("cpu"),
        augment_on=True,
        num_workers=0,
        image_size=8,
    )


@pytest.mark.parametrize("start", [0, 1, 3, 5])
def test_loader_resumes_at_any_step(start: int) -> None:
    plan = BatchPlan(96, 16, seed=2, rank=1, world_size=2, micro_batch=4)
    full = list(synthetic_loader(plan).epoch(1, 0))
    resumed = list(synthetic_loader(plan).epoch(1, start))
    assert [s for s, _ in resumed] == list(range(start, plan.steps_per_epoch))
    for (s_full, micro_full), (s_res, micro_res) in zip(full[start:], resumed, strict=True):
        assert s_full == s_res
        assert len(micro_full) == plan.accumulation == 2
        for (x1, y1), (x2, y2) in zip(micro_full, micro_res, strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_plan_rejects_a_rank_without_samples() -> None:
    """More ranks than samples in the batch: one line naming both fixes (exit 2 as bad input)."""
    line = one_line_bad_input(BatchPlan, 100, 3, 0, 0, 4)
    assert "3 is smaller than the world size 4" in line and "1 rank(s) would get no samples" in line
    assert "larger than the training set" in one_line_bad_input(BatchPlan, 10, 32, 0)
    assert BatchPlan(100, 30, 0, 3, 4).shares == (8, 8, 7, 7)  # uneven shares are fine
    assert BatchPlan(100, 32, 0, 0, 2, 5).accumulation == 4  # micro need not divide the share


def test_uneven_loader_micro_batches_put_together_are_the_one_rank_batch() -> None:
    """Real loader, augmentation on: 3 ranks' micro-batches of a 16-sample step (shares 6/5/5, at most 4
    per pass: 3+3, 2+3, 2+3) concatenate to the 1-rank loader's step, pixel for pixel."""
    whole = dict(synthetic_loader(BatchPlan(96, 16, seed=2)).epoch(1, 0))
    ranks = [dict(synthetic_loader(BatchPlan(96, 16, 2, r, 3, 4)).epoch(1, 0)) for r in range(3)]
    assert [[len(y) for _, y in ranks[r][0]] for r in range(3)] == [[3, 3], [2, 3], [2, 3]]
    for step, ((x, y),) in whole.items():
        parts = [mb for r in range(3) for mb in ranks[r][step]]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)


# ------------------------------------------------------------------------------------------ augmentation


def reference_crop_flip(img: torch.Tensor, dy: int, dx: int, flip: bool, pad: int = 4) -> torch.Tensor:
    """RandomCrop(padding=4, zero fill) + horizontal flip, spelled out for one image."""
    c, h, w = img.shape
    padded = torch.zeros(c, h + 2 * pad, w + 2 * pad, dtype=img.dtype)
    padded[:, pad : pad + h, pad : pad + w] = img
    out = padded[:, dy : dy + h, dx : dx + w]
    return out.flip(-1) if flip else out


def test_augment_equals_a_hand_written_crop_and_flip() -> None:
    g = torch.Generator().manual_seed(0)
    n = 40
    images = torch.randint(1, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)  # no zeros: padding shows
    dy = torch.randint(0, 9, (n,), generator=g)
    dx = torch.randint(0, 9, (n,), generator=g)
    dy[:4], dx[:4] = torch.tensor([0, 8, 0, 8]), torch.tensor([0, 8, 8, 0])  # the extreme corners
    flip = torch.arange(n) % 2 == 0
    out = augment(images, dy, dx, flip)
    assert out.shape == images.shape and out.dtype == torch.uint8
    for i in range(n):
        want = reference_crop_flip(images[i], int(dy[i]), int(dx[i]), bool(flip[i]))
        assert torch.equal(out[i], want), f"sample {i} (dy={int(dy[i])}, dx={int(dx[i])}, flip={bool(flip[i])})"
    # dy = dx = 8, no flip: the last 4 rows and columns are padding, the rest is the image shifted by 4
    assert (out[1, :, 28:, :] == 0).all() and (out[1, :, :, 28:] == 0).all()
    assert torch.equal(out[1, :, :28, :28], images[1, :, 4:, 4:])


def test_normalizer_uses_mean_and_std() -> None:
    norm = Normalizer((0.5, 0.25, 0.0), (0.5, 0.25, 1.0), torch.device("cpu"), channels_last=True)
    x = norm(torch.full((1, 3, 2, 2), 255, dtype=torch.uint8))
    assert torch.allclose(x[0, :, 0, 0], torch.tensor([1.0, 3.0, 1.0]))
    assert x.is_contiguous(memory_format=torch.channels_last)


# ------------------------------------------------------------------------------------------ evaluation shards


@pytest.mark.parametrize("n", [1, 7, 511, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_eval_shards_cover_every_sample_exactly_once(n: int, world: int) -> None:
    shards = [eval_shard(n, r, world) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1  # balanced: no rank waits for a much longer one


# ------------------------------------------------------------------------------------------ image folders


def test_missing_root_is_named(tmp_path: Path) -> None:
    msg = one_line_bad_input(data_mod.scan_imagefolder, tmp_path / "nowhere")
    assert msg.startswith("data error:") and str(tmp_path / "nowhere") in msg and "class folders" in msg


def test_root_without_class_folders(tmp_path: Path) -> None:
    (tmp_path / "loose.png").write_bytes(b"")
    msg = one_line_bad_input(data_mod.scan_imagefolder, tmp_path)
    assert "no class folders" in msg and str(tmp_path) in msg


def test_class_folders_without_images(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    msg = one_line_bad_input(data_mod.scan_imagefolder, tmp_path)
    assert "no images" in msg and ".png" in msg


def test_scan_is_sorted_and_labels_follow_class_order(tmp_path: Path) -> None:
    write_folder(tmp_path, {"zebra": 2, "ant": 3})
    (tmp_path / ".hidden").mkdir()
    classes, files, labels = data_mod.scan_imagefolder(tmp_path)
    assert classes == ["ant", "zebra"]
    assert labels == [0, 0, 0, 1, 1]
    assert files == sorted(files)


@pytest.mark.parametrize("loader", ["auto", "pil"])
def test_corrupt_image_is_named(tmp_path: Path, loader: str) -> None:
    root = tmp_path / "data"
    write_folder(root, {"a": 3, "b": 3})
    bad = root / "b" / "0001.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    cfg = folder_cfg(root, tmp_path / "cache", loader=loader, num_workers=0, val_fraction=0.5)

    def load_everything() -> None:
        bundle = data_mod.load_bundle(cfg)
        for s in (bundle.train, bundle.val):  # the pil path decodes lazily: touch every file
            for f in s.files or []:
                data_mod.decode_image(f, 32)

    msg = one_line_bad_input(load_everything)
    assert str(bad) in msg and "delete or replace" in msg


def test_decode_cache_is_reused_and_rebuilt_when_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, cache = tmp_path / "data", tmp_path / "cache"
    files = write_folder(root, {"a": 4, "b": 4})
    cfg = folder_cfg(root, cache, val_fraction=0.25)
    decoded: list[str] = []
    real_decode_all = data_mod.decode_all

    def counting_decode_all(paths: list[str], size: int) -> np.ndarray | None:
        decoded.extend(paths)
        return real_decode_all(paths, size)

    monkeypatch.setattr(imagefolder_reader, "decode_all", counting_decode_all)
    first = data_mod.load_bundle(cfg)
    assert len(decoded) == 8 and first.train.images is not None  # the tensor path
    assert len(list(cache.glob("imagefolder-*/images.npy"))) == 1

    decoded.clear()
    second = data_mod.load_bundle(cfg)
    assert decoded == []  # nothing decoded again
    assert torch.equal(first.train.images, second.train.images)

    changed = files[5]
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(changed)
    os.utime(changed, ns=(1, 1))  # a different mtime even on coarse-timestamp file systems
    third = data_mod.load_bundle(cfg)
    assert len(decoded) == 8  # rebuilt
    assert len(list(cache.glob("imagefolder-*/images.npy"))) == 2
    everything = torch.cat([third.train.images, third.val.images])
    assert (everything.flatten(1) == 0).all(1).sum() == 1  # the new black image is in the data


def test_decode_all_equals_decode_image_for_every_mode_and_stops_at_another_size(tmp_path: Path) -> None:
    files = [str(p) for p in write_folder(tmp_path / "rgb", {"a": 3})]
    gray, rgba, jpeg = tmp_path / "gray.png", tmp_path / "rgba.png", tmp_path / "photo.jpg"
    rng = np.random.default_rng(5)
    Image.fromarray(rng.integers(0, 256, (32, 32), dtype=np.uint8), mode="L").save(gray)
    Image.fromarray(rng.integers(0, 256, (32, 32, 4), dtype=np.uint8), mode="RGBA").save(rgba)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(jpeg, quality=75)
    files += [str(gray), str(rgba), str(jpeg)]
    together = data_mod.decode_all(files, 32)
    assert together is not None and together.shape == (6, 3, 32, 32) and together.dtype == np.uint8
    assert torch.equal(torch.from_numpy(together), torch.stack([data_mod.decode_image(f) for f in files]))
    other = write_folder(tmp_path / "big", {"b": 1}, size=40)
    assert data_mod.decode_all(files + [str(other[0])], 32) is None


def test_split_is_fixed_disjoint_and_complete(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_folder(root, {"a": 10, "b": 10, "c": 10})
    cfg = folder_cfg(root, tmp_path / "cache", val_fraction=0.2)
    b1, b2 = data_mod.load_bundle(cfg), data_mod.load_bundle(cfg)
    assert len(b1.val) == 6 and len(b1.train) == 24
    assert torch.equal(b1.val.images, b2.val.images)
    train_idx, val_idx = data_mod.split_indices(30, 0.2, 0)
    assert sorted(torch.cat([train_idx, val_idx]).tolist()) == list(range(30))
    other_train, _ = data_mod.split_indices(30, 0.2, 1)
    assert set(other_train.tolist()) != set(train_idx.tolist())  # split_seed moves the split


def test_max_train_samples_draws_from_every_class(tmp_path: Path) -> None:
    """Folders are scanned class by class; the first N training samples must not be one class."""
    root = tmp_path / "data"
    write_folder(root, {"a": 20, "b": 20, "c": 20, "d": 20})
    bundle = data_mod.load_bundle(folder_cfg(root, tmp_path / "cache", max_train_samples=16, max_val_samples=6))
    assert len(bundle.train) == 16 and len(bundle.val) == 6
    assert len(set(bundle.train.labels.tolist())) >= 3
    assert len(set(bundle.val.labels.tolist())) >= 2


def test_pil_path_resizes_images_of_any_size(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_folder(root, {"a": 3}, size=40)
    write_folder(root, {"b": 3}, size=24, seed=1)
    bundle = data_mod.load_bundle(folder_cfg(root, tmp_path / "cache", val_fraction=0.34, num_workers=0))
    assert bundle.train.images is None and bundle.train.files  # mixed sizes: the per-sample path
    assert data_mod.decode_image(bundle.train.files[0], 32).shape == (3, 32, 32)


def test_tensor_loader_refuses_mixed_sizes(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_folder(root, {"a": 2}, size=40)
    write_folder(root, {"b": 2}, size=24, seed=1)
    msg = one_line_bad_input(data_mod.load_bundle, folder_cfg(root, tmp_path / "cache", loader="tensor"))
    assert "data.loader" in msg and "differ in size" in msg


# ------------------------------------------------------------------------------------------ synthetic


def test_synthetic_is_deterministic() -> None:
    cfg = DataConfig(synthetic_train_size=64, synthetic_val_size=33, synthetic_classes=5)
    a, b = data_mod.make_synthetic(cfg), data_mod.make_synthetic(cfg)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.train.labels, b.train.labels)
    assert torch.equal(a.val.images, b.val.images)
    assert a.train.images.shape == (64, 3, 32, 32) and len(a.val) == 33 and a.num_classes == 5
    assert a.mean == b.mean and a.std == b.std
    c = data_mod.make_synthetic(
        DataConfig(synthetic_train_size=64, synthetic_val_size=33, synthetic_classes=5, split_seed=1)
    )
    assert not torch.equal(a.train.images, c.train.images)


def test_cifar10_offline_and_missing_names_the_path_and_fixes(tmp_path: Path) -> None:
    msg = one_line_bad_input(data_mod.load_bundle, DataConfig(name="cifar10", root=str(tmp_path), download=False))
    assert str(tmp_path / "cifar-10-batches-py") in msg
    assert "data.download=true" in msg and "data.name=imagefolder" in msg


# ------------------------------------------------------------------------------------------ start-up prefetch


@pytest.mark.parametrize(
    "env, overrides", [({"LOCAL_RANK": "1"}, {}), ({}, {"loader": "pil"}), ({}, {"name": "synthetic"})]
)
def test_prefetch_only_where_the_cache_gets_built(tmp_path: Path, env: dict, overrides: dict) -> None:
    cfg = folder_cfg(tmp_path, tmp_path / "cache")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    assert folder_cache.start_prefetch(cfg, env=env) is None


@pytest.mark.parametrize("channels_last", [False, True])
def test_channel_stats_equal_float64_sums(channels_last: bool) -> None:
    """The histogram path gives the mean/std a float64 pass over every pixel gives (skewed data, any layout)."""
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(300, 3, 16, 16, generator=g) ** torch.tensor([1.0, 2.0, 0.5])[:, None, None] * 255).to(
        torch.uint8
    )
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    x = images.to(torch.float64) / 255
    mean, std = data_mod.channel_stats(images)
    assert mean == tuple(round(v, 4) for v in x.mean(dim=(0, 2, 3)).tolist())
    assert std == tuple(round(v, 4) for v in x.std(dim=(0, 2, 3), unbiased=False).tolist())


def test_channel_stats_of_a_constant_channel_cannot_divide_by_zero() -> None:
    images = torch.zeros(4, 1, 8, 8, dtype=torch.uint8) + 7
    mean, std = data_mod.channel_stats(images)
    assert mean == (round(7 / 255, 4),) and std[0] > 0


def test_folder_fingerprint_is_the_relpath_key_for_any_spelling_of_root(tmp_path: Path) -> None:
    """The key is sha256 over `relpath\\0size\\0mtime_ns` lines (caches written before keep their key),
    whatever form the root was given in, and changes when a file changes."""
    import hashlib

    root = tmp_path / "imgs"
    for cls, n in (("a", 3), ("b", 2)):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            (root / cls / f"{i}.png").write_bytes(b"x" * (i + 1))

    def by_relpath(r: Path, files: list[str]) -> str:
        h = hashlib.sha256()
        for f in files:
            st = os.stat(f)
            h.update(f"{os.path.relpath(f, r)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:24]

    _, files, _ = folders.scan_imagefolder(root)
    key = folder_cache.folder_fingerprint(root, files)
    assert key == by_relpath(root, files)
    for spelling in (f"{root}/", f"{tmp_path}/./imgs", f"{tmp_path}/imgs/../imgs", os.path.relpath(root)):
        assert folder_cache.folder_fingerprint(Path(spelling), files) == key
        assert folder_cache.folder_fingerprint(spelling, files) == key  # type: ignore[arg-type]
    (root / "b" / "0.png").write_bytes(b"changed")
    assert folder_cache.folder_fingerprint(root, files) != key


# ------------------------------------------------------------------------------------------ CIFAR-10 batches


def write_cifar_batches(root: Path, per_batch: int = 20, seed: int = 0) -> Path:
    """A miniature cifar-10-batches-py (random pixels, every class present) in the files' own pickle layout."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "batch_label": name,
            "labels": [int(v) for v in rng.integers(0, 10, per_batch)],
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
    meta = {
        "label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
        "num_cases_per_batch": per_batch,
        "num_vis": 3072,
    }
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder


def test_cifar10_native_reader_is_torchvisions_byte_for_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torchvision = pytest.importorskip("torchvision")
    write_cifar_batches(tmp_path)
    bundle = data_mod.load_bundle(DataConfig(name="cifar10", root=str(tmp_path), download=False))
    cifar_module = sys.modules[torchvision.datasets.CIFAR10.__module__]
    monkeypatch.setattr(cifar_module, "check_integrity", lambda *a, **k: True)  # the files are not the real ones
    for ours, train in ((bundle.train, True), (bundle.val, False)):
        ds = torchvision.datasets.CIFAR10(str(tmp_path), train=train, download=False)
        expected = torch.from_numpy(ds.data).permute(0, 3, 1, 2)
        assert ours.images.dtype == torch.uint8 and ours.images.is_contiguous()
        assert torch.equal(ours.images, expected)
        assert torch.equal(ours.labels, torch.tensor(ds.targets, dtype=torch.int64))
        assert bundle.classes == ds.classes
    assert len(bundle.train) == 100 and len(bundle.val) == 20


def test_cifar10_truncated_or_foreign_batch_is_one_line_and_runs_nothing(tmp_path: Path) -> None:
    folder = write_cifar_batches(tmp_path)
    batch = folder / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:5000])
    cfg = DataConfig(name="cifar10", root=str(tmp_path), download=False)
    msg = one_line_bad_input(data_mod.load_bundle, cfg)
    assert msg.startswith("data error: CIFAR-10 not found under") and "files corrupt" in msg, msg
    marker = tmp_path / "executed"
    batch.write_bytes(pickle.dumps(_Exploit(str(marker)), protocol=2))
    msg = one_line_bad_input(data_mod.load_bundle, cfg)
    assert "files corrupt" in msg and "unexpected object" in msg, msg
    assert not marker.exists()


class _Exploit:
    """A pickle that would create a file when loaded by a plain unpickler."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(self.path),))


def test_a_loader_workers_bad_input_comes_back_as_its_own_line() -> None:
    """torch raises a worker's error again as X(its traceback text), or a RuntimeError when X takes other
    arguments (ConfigError): the line that reaches the user is the worker's own (issue 52: a ShardError's
    was cut to torch's frames, before the shard, member and reason)."""
    from torch._utils import ExceptionWrapper

    from torchlaunch.config import ConfigError
    from torchlaunch.data.shards import ShardError
    from torchlaunch.worker.data.loaders import _reraise_bad_input

    deep = "x" * 3000  # a traceback longer than any error line's bound
    for error in (
        ShardError("train-000003.tar member a/b.jpg is corrupt (checksum mismatch)", "restore it"),
        ConfigError("data.name", "'p:f': train sample 7 label is str 'x'", "return an int label"),
    ):
        try:
            exec(f"def frame_{deep}():\n    raise error\nframe_{deep}()", {"error": error})
        except BadInput:
            wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
        with pytest.raises(Exception) as raised:
            wrapped.reraise()
        assert "Original Traceback" in str(raised.value) or str(raised.value) == str(error)
        with pytest.raises(BadInput) as recovered:
            _reraise_bad_input(raised.value)
        assert str(recovered.value) == str(error)
