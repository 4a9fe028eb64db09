"""test_gpu_decode_loader: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_gpu_decode.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_gpu_decode import CPU, SIZE, _bundle, _scene, shard_root, sources  # noqa: F401 (fixtures, used by name)
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.worker.data import Normalizer, TrainLoader

pytestmark = pytest.mark.timeout(120)


def test_the_loader_on_gpu_decode_yields_the_same_steps(shard_root: Path, tmp_path: Path) -> None:
    """TrainLoader's data.decode=gpu wiring (workers, collate, to_batch) run on the CPU: the same
    indices, boxes and flips per step as data.decode=cpu, with 0 and 2 workers, images close."""
    bundle = _bundle("shards", shard_root, tmp_path)
    norm = Normalizer(bundle.mean, bundle.std, CPU, False)

    def steps(decode: str, workers: int) -> list[tuple[dict, torch.Tensor]]:
        plan = BatchPlan(len(bundle.train), 8, 4, train_crop="resized", image_size=SIZE)
        loader = TrainLoader(bundle.train, plan, norm, CPU, True, workers, SIZE, trace=True)
        loader.decode = decode  # the CUDA check is the constructor's; the path itself runs on any device
        out = []
        for _, micro in loader.epoch(1, 0):
            out.append((dict(loader.step_trace), torch.cat([x for x, _ in micro])))
        return out

    reference = steps("cpu", 0)
    assert len(reference) == len(bundle.train) // 8
    for workers in (0, 2):
        got = steps("gpu", workers)
        assert [t for t, _ in got] == [t for t, _ in reference]
        for (_, x), (_, y) in zip(got, reference, strict=True):
            assert (x - y).abs().mean() < 0.05  # normalised units: < ~1/255 of a pixel value on average


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_rank_without_cuda_refuses_gpu_decode_in_one_line_exit_2(shard_root: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.helpers import REPO

    overrides = [f"data.root={shard_root}", "data.train_crop=resized", "data.decode=gpu", f"data.image_size={SIZE}"]
    done = subprocess.run(
        [sys.executable, "-m", "train", "--config", "configs/smoke.yaml", "data.name=shards", *overrides,
         f"run_dir={tmp_path / 'run'}", "train.epochs=1", "train.batch_size=8"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and "data.decode" in lines[0] and "use data.decode=cpu" in lines[0], lines
