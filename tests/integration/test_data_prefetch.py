"""test_data_prefetch: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_data.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_cmd
from tests.unit.test_data import folder_cfg, one_line_bad_input, write_cifar_batches, write_folder
from torchlaunch.worker import data as data_mod
from torchlaunch.worker import folder_cache
from torchlaunch.worker.data import imagefolder as imagefolder_reader


def test_prefetch_child_publishes_the_cache_the_worker_then_loads(tmp_path: Path) -> None:
    root, cache = tmp_path / "data", tmp_path / "cache"
    write_folder(root, {"a": 3, "b": 3})
    cfg = folder_cfg(root, cache)
    child = folder_cache.start_prefetch(cfg, env={})
    assert child is not None
    folder_cache.finish_prefetch(child)
    assert child.returncode == 0
    published = list(cache.glob("imagefolder-*/images.npy"))
    assert len(published) == 1 and not list(cache.glob(".imagefolder-*"))  # no temp folder left
    _, files, _ = data_mod.scan_imagefolder(root)
    assert np.array_equal(np.load(published[0]), data_mod.decode_all(files, 32))
    bundle = data_mod.load_bundle(cfg)  # finds it: nothing left to decode
    assert bundle.train.images is not None and len(bundle.train) + len(bundle.val) == 6


def test_worker_takes_the_prefetch_scan_once_and_loads_what_its_own_scan_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, cache = tmp_path / "data", tmp_path / "cache"
    write_folder(root, {"b": 3, "a": 5, "c": 2})
    cfg = folder_cfg(root, cache)
    scanned = data_mod.load_bundle(cfg)  # builds the cache through the worker's own scan
    folder_cache.finish_prefetch(folder_cache.start_prefetch(cfg, env={}))

    def no_scan(root: Path) -> None:
        raise AssertionError("scanned again")

    monkeypatch.setattr(imagefolder_reader, "scan_imagefolder", no_scan)
    prefetched = data_mod.load_bundle(cfg)
    assert prefetched.classes == scanned.classes == ["a", "b", "c"]
    for a, b in ((prefetched.train, scanned.train), (prefetched.val, scanned.val)):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and a.labels.dtype == torch.int64
    assert (prefetched.mean, prefetched.std) == (scanned.mean, scanned.std)
    with pytest.raises(AssertionError, match="scanned again"):  # taken once: a later load scans anew
        data_mod.load_bundle(cfg)
    monkeypatch.undo()
    smaller = folder_cfg(root, cache, image_size=16)  # the cache holds 32x32: the index must not be used
    folder_cache.finish_prefetch(folder_cache.start_prefetch(smaller, env={}))
    resized = data_mod.load_bundle(smaller)
    assert resized.train.images is None and len(resized.train.files) == len(scanned.train)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other_count"])
def test_damaged_decode_cache_is_rebuilt_not_a_crash(tmp_path: Path, damage: str) -> None:
    root, cache = tmp_path / "data", tmp_path / "cache"
    write_folder(root, {"a": 4, "b": 4})
    cfg = folder_cfg(root, cache)
    clean = data_mod.load_bundle(cfg)
    (published,) = cache.glob("imagefolder-*/images.npy")
    if damage == "truncate":
        published.write_bytes(published.read_bytes()[:-100])
    elif damage == "garbage":
        published.write_bytes(b"not an array")
    else:
        np.save(published, np.zeros((5, 3, 32, 32), dtype=np.uint8))
    folder_cache.finish_prefetch(folder_cache.start_prefetch(cfg, env={}))  # the child's index too
    rebuilt = data_mod.load_bundle(cfg)
    assert torch.equal(rebuilt.train.images, clean.train.images) and torch.equal(rebuilt.val.labels, clean.val.labels)
    (republished,) = cache.glob("imagefolder-*/images.npy")
    _, files, _ = data_mod.scan_imagefolder(root)
    assert np.array_equal(np.load(republished), data_mod.decode_all(files, 32))  # the next start reads it


def test_prefetch_leaves_problems_to_the_worker(tmp_path: Path) -> None:
    root, cache = tmp_path / "data", tmp_path / "cache"
    files = write_folder(root, {"a": 2, "b": 2})
    files[1].write_bytes(b"not an image")
    child = folder_cache.start_prefetch(folder_cfg(root, cache), env={})
    folder_cache.finish_prefetch(child)
    assert child.returncode == 2 and not list(cache.glob("*/images.npy")) and not list(cache.glob(".imagefolder-*"))
    msg = one_line_bad_input(data_mod.load_bundle, folder_cfg(root, cache))  # the worker's own message
    assert "cannot decode image" in msg and str(files[1]) in msg


@pytest.mark.timeout(200)
def test_default_recipe_worker_never_imports_torchvision(tmp_path: Path) -> None:
    """configs/cifar10.yaml (cifar10 batches, resnet18) in a real worker, in-process so sys.modules can be
    read after it returns: torchvision (and the torch._dynamo it imports) is no part of its start-up."""
    write_cifar_batches(tmp_path / "data", per_batch=64)
    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}",
        f"data.root={tmp_path / 'data'}",
        "data.download=false",
        "train.max_steps=1",
        "train.batch_size=32",
        "data.max_val_samples=32",
        "train.precision=fp32",
        "train.log_every_steps=1",
        "checkpoint.every_steps=0",
    ]
    probe = (
        "import sys; from torchlaunch.worker.run import main; "
        f"code = main(['--config', 'configs/cifar10.yaml', *{overrides!r}]); "
        "print('TORCHVISION', 'torchvision' in sys.modules, 'DYNAMO', 'torch._dynamo' in sys.modules); "
        "sys.exit(code)"
    )
    rc, out, err = run_cmd([sys.executable, "-c", probe], timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert rc == 0, out + err
    assert "starting resnet18" in out + err
    assert "TORCHVISION False DYNAMO False" in out, out
