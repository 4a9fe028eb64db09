"""data.name=shards (issue 27): a shard set written by `python -m train.shards write` from mixed-size
JPEGs is read per sample by the worker (train and val), keeps the batch plan's world-size-invariant
resized crops, is judged by the launchers' pre-spawn check (one line, exit 2, before any rank
starts), by train.evaluate's data detection, and is what configs/imagenet.yaml validates and dry-runs
against."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, launcher
from tests.unit.test_resized_crop import _traced_epoch, write_jpegs
from torchlaunch.config import DataConfig
from torchlaunch.data.formats.shards import check_shards
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data import Normalizer, ShardSamples, eval_batches, load_bundle
from torchlaunch.worker.evaluate import detect_data_name


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("shards")
    write_jpegs(base / "imgs", classes=3, per_class=16)
    out = base / "set"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.shards",
            "write",
            "--from",
            str(base / "imgs"),
            "--out",
            str(out),
            "--val-fraction",
            "0.2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_the_worker_reads_a_shard_set_per_sample_with_world_size_invariant_crops(shard_set: Path) -> None:
    cfg = DataConfig(name="shards", root=str(shard_set), image_size=24, train_crop="resized")
    bundle = load_bundle(cfg)
    assert isinstance(bundle.train.files, ShardSamples) and bundle.train.images is None
    assert bundle.classes == ["c0", "c1", "c2"] and len(bundle.train) + len(bundle.val) == 48
    reference, batch = _traced_epoch(bundle, 1, 0)
    assert len(reference) == 3 and batch.dtype == torch.float32
    assert _traced_epoch(bundle, 3, 1)[0] == reference and _traced_epoch(bundle, 2, 0)[0] == reference
    sizes = bundle.train.files.shards.sizes
    for step in reference.values():  # each box inside its own image, from the index's sizes
        for i, (left, top, w, h) in zip(step[0], step[1], strict=True):
            width, height = sizes[int(bundle.train.files.index[i])]
            assert left + w <= width and top + h <= height
    norm = Normalizer(bundle.mean, bundle.std, torch.device("cpu"), False)
    seen = sum(x.shape[0] for x, _ in eval_batches(bundle.val, 0, 1, 4, norm, torch.device("cpu"), 24, 1, 28))
    assert seen == len(bundle.val)
    assert detect_data_name(shard_set, "auto") == "shards"


def test_a_truncated_shard_is_one_line_exit_2_before_any_rank_starts(shard_set: Path, tmp_path: Path) -> None:
    check_shards(shard_set)  # the good set passes
    broken = tmp_path / "set"
    subprocess.run(["cp", "-r", str(shard_set), str(broken)], check=True)
    shard = sorted((broken / "train").glob("*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(BadInput):
        check_shards(broken)
    done = launcher(
        ["--gpus", "1", "--config", "configs/smoke.yaml", "data.name=shards", f"data.root={broken}", "--dry-run"]
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "data error" in lines[0] and shard.name in lines[0], done.stderr


def test_imagenet_recipe_validates_and_dry_runs(shard_set: Path, tmp_path: Path) -> None:
    done = launcher(
        [
            "--gpus",
            "2",
            "--device",
            "cpu",
            "--config",
            "configs/imagenet.yaml",
            f"data.root={shard_set}",
            f"run_dir={tmp_path / 'run'}",
            "--dry-run",
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchlaunch.agent.live --nproc 2" in done.stdout, done.stdout  # two ranks: the live road


def test_clean_decode_proofs_cross_the_forked_workers_and_change_no_pixel(shard_set: Path) -> None:
    """The window decoder's proofs (worker/data/shards.CleanDecodes): what a DataLoader worker proves
    in epoch 0 (a decode read to the end marker) is seen by the parent and by the workers of epoch 1,
    whose draws of those members stop after their box; epoch 1's batches are bit for bit those of a
    loader that never saw epoch 0 (no proofs: every draw read to the end), and of one without the
    window decoder at all."""
    from torchlaunch.core.sampler import BatchPlan
    from torchlaunch.worker.data import TrainLoader, jpeg

    if jpeg.window_decoder() is None:
        pytest.skip("the window decoder was not built here")
    cfg = DataConfig(name="shards", root=str(shard_set), image_size=24, train_crop="resized")

    def epoch_1(bundle, workers: int, first: bool) -> list[torch.Tensor]:
        plan = BatchPlan(len(bundle.train), 12, 3, train_crop="resized", image_size=24)
        norm = Normalizer(bundle.mean, bundle.std, torch.device("cpu"), False)
        loader = TrainLoader(bundle.train, plan, norm, torch.device("cpu"), True, workers, 24)
        if first:
            for _ in loader.epoch(0, 0):
                pass
        return [micro[0][0] for _, micro in loader.epoch(1, 0)]

    proven = load_bundle(cfg)
    clean = proven.train.files.clean
    assert not any(j in clean for j in range(clean.n))
    ours = epoch_1(proven, 2, True)
    assert sum(j in clean for j in range(clean.n)) > clean.n // 2  # recorded by the workers, seen here
    fresh = epoch_1(load_bundle(cfg), 0, False)
    assert len(ours) == len(fresh) > 0 and all(torch.equal(a, b) for a, b in zip(ours, fresh, strict=True))
    decoder = jpeg.window_decoder
    try:
        jpeg.window_decoder = lambda: None
        whole = epoch_1(load_bundle(cfg), 0, False)
    finally:
        jpeg.window_decoder = decoder
    assert all(torch.equal(a, b) for a, b in zip(ours, whole, strict=True))


def test_a_corrupt_member_met_in_a_loader_worker_is_its_own_one_line(shard_set: Path, tmp_path: Path) -> None:
    """Issue 52: a corrupt member met inside a DataLoader worker was refused with exit 2, but its line was
    torch's flattened worker traceback, cut before the shard, member and reason. The worker's own line
    comes back: the same as the one a loader without workers gives."""
    from torchlaunch.core.sampler import BatchPlan
    from torchlaunch.worker.data import TrainLoader

    broken = tmp_path / "set"
    subprocess.run(["cp", "-r", str(shard_set), str(broken)], check=True)
    cfg = DataConfig(name="shards", root=str(broken), image_size=24, train_crop="resized")
    bundles = [load_bundle(cfg), load_bundle(cfg)]  # opened clean (the set's checks and stats pass)
    for shard in sorted((broken / "train").glob("*.tar")):  # then members' bytes damaged in place
        with shard.open("r+b") as fh:
            for at in range(1024, shard.stat().st_size - 2048, 4096):
                fh.seek(at)
                fh.write(b"\x00\xff")

    def refusal(bundle, workers: int) -> str:
        plan = BatchPlan(len(bundle.train), 12, 1, train_crop="resized", image_size=24)
        norm = Normalizer(bundle.mean, bundle.std, torch.device("cpu"), False)
        with pytest.raises(BadInput) as refused:
            for _ in TrainLoader(bundle.train, plan, norm, torch.device("cpu"), True, workers, 24).epoch(0, 0):
                pass
        return str(refused.value)

    inside, outside = refusal(bundles[0], 1), refusal(bundles[1], 0)
    assert inside.startswith("data error:") and "Traceback" not in inside and "\n" not in inside, inside
    assert ".tar member " in inside and "is corrupt (checksum mismatch)" in inside, inside
    assert inside == outside
