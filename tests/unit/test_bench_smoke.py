"""Smoke tests of the benchmark machinery at tiny sizes: each benchmark function returns well-formed
figures (finite, positive ratios with a goal and a command). No timing is asserted: the figures
themselves are produced by `make bench` and recorded in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from bench import amp, datapath, loop, peers, progress, proposals
from bench.common import Result, interleaved_steps, median_ratio, paired_rates, shared_tarball
from torchlaunch.jobs import progress as ops_progress
from torchlaunch.worker.data import BatchPlan, augment

needs_data = pytest.mark.skipif(
    shared_tarball() is None,
    reason="shared CIFAR-10 tarball not found (/work/shared/data or ../shared/data; set BENCH_CIFAR_TARBALL)",
)


@pytest.fixture
def bench_work(tmp_path: Path, cifar_shared: Path) -> Path:
    """A benchmark work folder whose CIFAR-10 copy is the session's (bench.common.unpacked_cifar finds it
    there and unpacks nothing): each benchmark otherwise unpacked the 50,000 images again."""
    (tmp_path / "cifar10-jpeg").mkdir()
    (tmp_path / "cifar10-jpeg" / "train").symlink_to(cifar_shared, target_is_directory=True)
    return tmp_path


def well_formed(r: Result) -> None:
    assert isinstance(r, Result)
    assert math.isfinite(r.ratio) and r.ratio > 0, r
    assert math.isfinite(r.project) and r.project > 0 and math.isfinite(r.baseline) and r.baseline > 0
    assert r.goal > 0 and r.command.startswith("python -m bench.run")
    assert r.rounds and all(x > 0 for x in r.rounds)
    json.dumps(r.to_dict())  # serialisable for docs/bench-results.json


def test_paired_helpers_alternate_and_pair() -> None:
    calls: list[str] = []
    rates = paired_rates({"a": lambda: calls.append("a") or 2.0, "b": lambda: calls.append("b") or 1.0}, 3, warmup=0)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert median_ratio(rates["a"], rates["b"]) == (2.0, [2.0, 2.0, 2.0])
    ra, rb = interleaved_steps(lambda: None, lambda: None, groups=2, per_group=2)
    assert len(ra) == len(rb) == 2


def test_proposed_augment_is_bit_identical() -> None:
    plan = BatchPlan(512, 64, seed=3)
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    for step in range(4):
        _, aug = plan.rank_step(plan.permutation(0), 0, step)
        assert torch.equal(datapath.flat_gather_augment(images, *aug), augment(images, *aug))


def test_loop_and_amp_quick() -> None:
    torch.set_num_threads(1)
    well_formed(loop.run(quick=True))
    well_formed(amp.run(quick=True))


def test_proposals_quick() -> None:
    for r in proposals.run(quick=True):
        well_formed(r)


@needs_data
def test_datapath_quick(bench_work: Path) -> None:
    r = datapath.run(quick=True, work=bench_work)
    well_formed(r)
    assert r.extra["proposed_gain"] > 0


def test_progress_steps_quick_reports_live_and_leaves_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process per-step figure writes real heartbeats (at least the first call's) and restores
    the environment: bench.run's later benchmarks must not report progress."""
    monkeypatch.delenv(ops_progress.PROGRESS_DIR_ENV, raising=False)
    monkeypatch.setattr(ops_progress, "_writer", None)
    r = progress.run_steps(quick=True)
    well_formed(r)
    written = int(r.notes.split("heartbeat file was written ", 1)[1].split()[0])
    assert written >= 1
    assert ops_progress.PROGRESS_DIR_ENV not in os.environ and ops_progress._writer is None


def test_progress_micro_costs_leave_the_environment_as_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.run measures heartbeat() in its own process: it must not leave a progress dir or writer behind."""
    monkeypatch.delenv(ops_progress.PROGRESS_DIR_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(ops_progress, "_writer", None)
    per_call, per_write = progress.heartbeat_costs(tmp_path, calls=100, writes=5)
    assert per_call > 0 and per_write > 0
    assert ops_progress.PROGRESS_DIR_ENV not in os.environ and ops_progress._writer is None
    assert [p.name for p in tmp_path.glob("rank-*.json")] == ["rank-0.json"]


def test_topk_correct_counts_rows_whose_target_is_in_the_top_k() -> None:
    from bench.peer_reference import topk_correct

    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    top1, top3 = topk_correct(logits, torch.tensor([1, 3, 0]), ks=(1, 3))
    assert top1.item() == pytest.approx(100 / 3) and top3.item() == pytest.approx(100 / 3)
    top1, top9 = topk_correct(logits, torch.tensor([1, 0, 3]), ks=(1, 9))  # k above the class count: all
    assert top1.item() == 100 and top9.item() == 100


@needs_data
def test_peer_folders_are_the_projects_two_splits(tmp_path: Path, cifar_shared: Path) -> None:
    """Peers train on exactly the project's training split and validate on exactly its held-out split."""
    from torchlaunch.worker.data import scan_imagefolder, split_indices

    project_root, peer_train, peer_val = peers.make_folders(cifar_shared, tmp_path, 200)
    _, files, _ = scan_imagefolder(project_root)
    train_idx, val_idx = split_indices(len(files), peers.VAL_FRACTION, 0)

    def names(idx) -> set[str]:
        return {f"{Path(files[i]).parent.name}/{Path(files[i]).name}" for i in idx.tolist()}

    def listed(folder: Path) -> set[str]:
        return {f"{f.parent.name}/{f.name}" for f in folder.glob("*/*")}

    assert listed(peer_train) == names(train_idx) and listed(peer_val) == names(val_idx)
    assert len(val_idx) >= 1 and not listed(peer_train) & listed(peer_val)
    assert len({p.name for p in peer_val.iterdir()}) == 10  # every class folder, so labels line up


def test_peer_sides_choose_their_own_threads() -> None:
    """bench.run sets OMP_NUM_THREADS=1 for itself; a side that inherited it would run on one thread."""
    env = peers.side_env({"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
    assert "OMP_NUM_THREADS" not in env
    assert env["PATH"] == "/usr/bin" and env["CUDA_VISIBLE_DEVICES"] == ""
