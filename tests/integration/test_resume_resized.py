"""Exact resume of the ImageNet recipe's data path (issue 27): a run on original-aspect JPEGs with
data.train_crop=resized, interrupted mid-epoch on 2 ranks and resumed on 3, and on 4 resumed on 3, with
different data.num_workers, draws in every remaining global step the same samples with the same crop
boxes and flips as one uninterrupted 3-rank run (from the batch trace), every rank taking its share of
every step. Real torchrun on CPU (gloo) through launch.local; one reference run for both cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import assert_models_equal, assert_states_equal, final_state, launcher
from tests.unit.test_resized_crop import write_jpegs

pytestmark = pytest.mark.slow

# 60 JPEGs -> 54 train / 6 val; batch 12 (divisible by 2, 3, 4) -> 4 steps per epoch, 2 epochs = 8 steps
TINY = [
    "model.width=4",
    "data.name=imagefolder",
    "data.image_size=32",
    "data.train_crop=resized",
    "data.loader=pil",
    "train.batch_size=12",
    "train.epochs=2",
    "train.log_every_steps=2",
    "checkpoint.every_steps=100",
    "debug.trace_batches=true",
]
TOTAL_STEPS = 8


def run(run_dir: Path, root: Path, gpus: int, workers: int, env: dict | None = None):
    args = ["--gpus", str(gpus), "--config", "configs/smoke.yaml", f"run_dir={run_dir}", f"data.root={root}"]
    restart = "recovery.live=false"  # the subject: the restart road's resume from a checkpoint, bit for bit
    return launcher([*args, f"data.cache_dir={root}.cache", f"data.num_workers={workers}", *TINY, restart], env=env)


def traced(run_dir: Path) -> dict[int, list]:
    """global step -> sorted (index, box, flip) of every sample any rank trained on, and the ranks
    that logged it (each must have a share of every step)."""
    steps: dict[int, list] = {}
    ranks: dict[int, set] = {}
    for f in sorted((run_dir / "trace").glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            assert len(rec["indices"]) == 12 // rec["world_size"] == len(rec["box"]) == len(rec["flip"])
            steps.setdefault(rec["step"], []).extend(
                zip(rec["indices"], map(tuple, rec["box"]), rec["flip"], strict=True)
            )
            ranks.setdefault(rec["step"], set()).add((rec["world_size"], f.name))
    for step, seen in ranks.items():
        world = {w for w, _ in seen}
        assert len(world) == 1 and len(seen) == world.pop(), f"step {step}: ranks {seen}"
    return {k: sorted(v) for k, v in steps.items()}


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jpegs") / "imgs"
    write_jpegs(root, classes=3, per_class=20)
    return root


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, jpegs: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    done = run(run_dir, jpegs, gpus=3, workers=0)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_dir: Path) -> dict[int, list]:
    return traced(reference_dir)


@pytest.mark.parametrize(
    "before,after,workers",
    [pytest.param(2, 3, (1, 3), id="2to3"), pytest.param(4, 3, (0, 1), id="4to3", marks=pytest.mark.extended)],
)
def test_resume_on_another_world_size_draws_the_same_crops(
    tmp_path: Path, jpegs: Path, reference: dict, before: int, after: int, workers: tuple[int, int]
) -> None:
    assert sorted(reference) == list(range(1, TOTAL_STEPS + 1))
    first = run(tmp_path, jpegs, before, workers[0], env={"TORCHLAUNCH_FAULT_SIGNAL": "at=step,n=2,rank=0"})
    assert first.returncode == 75, first.stderr[-2000:]
    second = run(tmp_path, jpegs, after, workers[1])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout + second.stderr
    resumed = traced(tmp_path)
    assert resumed == reference  # every global step: the same samples, boxes and flips


@pytest.mark.extended  # resized crops on shards resume bit for bit in CI's tier: test_outside_stops_local.py
def test_resume_on_the_same_world_size_is_bit_exact(tmp_path: Path, jpegs: Path, reference_dir: Path) -> None:
    """3 ranks interrupted mid-epoch with 1 DataLoader worker each, resumed on 3 with 2: the final weights,
    optimizer and scaler equal the uninterrupted 3-rank run's (0 workers) bit for bit. The crops are a
    pure function of (image, box, flip) on any worker count, so the pixels, not only the boxes, match."""
    first = run(tmp_path, jpegs, 3, 1, env={"TORCHLAUNCH_FAULT_SIGNAL": "at=step,n=3,rank=1"})
    assert first.returncode == 75, first.stderr[-2000:]
    second = run(tmp_path, jpegs, 3, 2)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout + second.stderr
    assert traced(tmp_path) == traced(reference_dir)
    assert_states_equal(final_state(reference_dir), final_state(tmp_path))
    assert_models_equal(reference_dir / "model.pt", tmp_path / "model.pt")
