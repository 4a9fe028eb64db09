"""test_models_torchvision: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_models.py.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, run_module


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_worker_trains_a_torchvision_model(tmp_path) -> None:
    """Two CPU steps through the real worker entry point with the stock torchvision ResNet-18."""
    run_dir = tmp_path / "run"
    rc, out, err = run_module(
        "train",
        [
            "--config",
            str(REPO / "configs/smoke.yaml"),
            f"run_dir={run_dir}",
            "model.name=torchvision.resnet18",
            "model.width=0",
            "data.synthetic_train_size=64",
            "data.synthetic_val_size=16",
            "train.batch_size=32",
            "train.epochs=1",
            "train.log_every_steps=1",
        ],
        timeout=140,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert rc == 0, out + err
    assert "starting torchvision.resnet18" in out + err
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("step") == 2 for s in steps), steps
