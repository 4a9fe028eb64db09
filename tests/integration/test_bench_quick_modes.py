"""test_bench_quick_modes: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_bench_smoke.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import ckpt, ddp, exact, peers, progress, run
from bench.common import REPO, subset_folder
from tests.unit.test_bench_smoke import (
    bench_work,  # noqa: F401 (fixtures, used by name)
    needs_data,
    well_formed,
)


@pytest.mark.slow
@pytest.mark.extended
def test_ddp_quick() -> None:
    scaling, adopted = ddp.run(quick=True)
    well_formed(scaling)
    well_formed(adopted)
    assert scaling.project == adopted.project  # the same 2-rank runs, two baselines


@pytest.mark.slow
@pytest.mark.extended
def test_exact_quick() -> None:
    (smoke,) = exact.run(quick=True)
    well_formed(smoke)
    assert smoke.key == "exact-smoke"


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


def test_run_writes_benchmarks_md(tmp_path: Path) -> None:
    assert run.main(["--quick", "--only", "loop", "amp", "--docs", str(tmp_path), "--work", str(tmp_path)]) == 0
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "Loop overhead" in text and "AMP on CPU" in text and "python -m bench.run --only loop" in text
    stored = json.loads((tmp_path / "bench-results.json").read_text())
    assert set(stored["results"]) == {"loop", "amp"}


@pytest.mark.slow
@pytest.mark.extended
def test_elastic_quick() -> None:
    """Two loopback launchers, one SIGKILLed: both degraded-restart figures come back well formed."""
    from bench import elastic

    recovery, throughput = elastic.run(quick=True)
    well_formed(recovery)
    well_formed(throughput)
    assert recovery.unit == "s" and recovery.project > 0 and throughput.unit == "steps/s"
