"""Smoke tests of the benchmark machinery at tiny sizes: each benchmark function returns well-formed
figures (finite, positive ratios with a goal and a command). No timing is asserted: the figures
themselves are produced by `make bench` and recorded in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import amp, ckpt, datapath, ddp, loop, peers, progress, proposals, run
from bench.common import REPO, Result, interleaved_steps, median_ratio, paired_rates, shared_tarball, subset_folder
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


@pytest.mark.slow
@pytest.mark.extended
def test_ddp_quick() -> None:
    scaling, adopted = ddp.run(quick=True)
    well_formed(scaling)
    well_formed(adopted)
    assert scaling.project == adopted.project  # the same 2-rank runs, two baselines


@pytest.mark.slow
@pytest.mark.extended
def test_ckpt_quick() -> None:
    results, pre = ckpt.run(quick=True)
    for r in results:
        well_formed(r)
    assert pre["committed_step"] >= 2 and pre["resumed_at_step"] == pre["committed_step"]
    assert pre["continuous"] and pre["steps_lost"] == 0 and pre["rerun_exit"] == 0
    assert pre["signal_to_commit_s"] >= 0


@pytest.mark.slow
@pytest.mark.extended
def test_progress_quick() -> None:
    """Both sides launch for real; each run checks its own heartbeat files (on: both ranks, off: none)."""
    r = progress.run(quick=True)
    well_formed(r)
    assert r.extra["heartbeat_call_us"] > 0 and r.extra["heartbeat_write_us"] > 0
    assert 0 < r.extra["added_fraction_of_step"] < 0.01


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


@pytest.mark.slow
@pytest.mark.extended
@needs_data
def test_peers_quick(bench_work: Path) -> None:
    """The project side and both peer scripts end to end at tiny size. The peers run with the
    project's python when the benchmark venv (Lightning) is absent: Lightning is then skipped."""
    from bench.common import peers_python

    py = peers_python()
    has_lightning = py.is_file() and subprocess.run([str(py), "-c", "import lightning"]).returncode == 0
    if not has_lightning:
        pytest.skip("bench/.venv-peers with lightning not created (python -m bench.run --only peers creates it)")
    results = peers.run(py, quick=True, work=bench_work)
    assert results and len(results) == 2
    for r in results:
        well_formed(r)


@needs_data
def test_reference_loop_script_runs(tmp_path: Path, cifar_shared: Path) -> None:
    """The reference-style loop trains, evaluates the val folder and writes its checkpoint twice, as
    torchvision's train.py does with --output-dir."""
    full = cifar_shared
    tiny, val = subset_folder(full, tmp_path / "tiny", 4), subset_folder(full, tmp_path / "val", 1)
    save = tmp_path / "out"
    save.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.peer_reference",
            "--data",
            str(tiny),
            "--val",
            str(val),
            "--batch",
            "8",
            "--workers",
            "0",
            "--model",
            "tiny",
            "--print-freq",
            "2",
            "--save",
            str(save),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["images"] == 40 and 0 <= result["val_acc"] <= 100
    assert sum(line.startswith("Epoch: [0] [") for line in lines) == 2  # 5 steps, a line every 2
    assert any(line.startswith("Test: Acc@1") for line in lines)
    assert sorted(f.name for f in save.iterdir()) == ["checkpoint.pth", "model_0.pth"]
    saved = torch.load(save / "checkpoint.pth", weights_only=True)
    assert set(saved) == {"model", "optimizer", "lr_scheduler", "epoch"}


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


def test_run_writes_benchmarks_md(tmp_path: Path) -> None:
    assert run.main(["--quick", "--only", "loop", "amp", "--docs", str(tmp_path), "--work", str(tmp_path)]) == 0
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "Loop overhead" in text and "AMP on CPU" in text and "python -m bench.run --only loop" in text
    stored = json.loads((tmp_path / "bench-results.json").read_text())
    assert set(stored["results"]) == {"loop", "amp"}


def test_peer_sides_choose_their_own_threads() -> None:
    """bench.run sets OMP_NUM_THREADS=1 for itself; a side that inherited it would run on one thread."""
    env = peers.side_env({"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
    assert "OMP_NUM_THREADS" not in env
    assert env["PATH"] == "/usr/bin" and env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.slow
@pytest.mark.extended
def test_elastic_quick() -> None:
    """Two loopback launchers, one SIGKILLed: both degraded-restart figures come back well formed."""
    from bench import elastic

    recovery, throughput = elastic.run(quick=True)
    well_formed(recovery)
    well_formed(throughput)
    assert recovery.unit == "s" and recovery.project > 0 and throughput.unit == "steps/s"
