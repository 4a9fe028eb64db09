"""test_airbench_peer: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_airbench_peer_cpu_run.py.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from bench import airbench_peer
from tests.integration.test_airbench_peer_cpu_run import CLASSES
from tests.unit.test_data import write_folder
from torchlaunch.config import DataConfig
from torchlaunch.worker.data import load_bundle


def test_pack_writes_airbench_layout_from_the_project_split(tmp_path: Path) -> None:
    write_folder(tmp_path / "train", CLASSES, size=32)
    write_folder(tmp_path / "test", {"cat": 3, "dog": 2, "frog": 4}, size=32, seed=1)
    cache = str(tmp_path / "cache")
    packed = airbench_peer.pack(str(tmp_path / "train"), str(tmp_path / "test"), tmp_path / "work", cache)
    folder = tmp_path / "work" / "cifar10"
    assert airbench_peer.check_pack(folder) == {"train": (27, 32, 32, 3), "test": (9, 32, 32, 3)}
    assert packed["train_images"] == 27 and packed["test_images"] == 9
    train = torch.load(folder / "train.pt", weights_only=True)
    bundle = load_bundle(DataConfig(name="imagefolder", root=str(tmp_path / "train"), cache_dir=cache, loader="tensor"))
    assert torch.equal(train["images"], bundle.train.images.permute(0, 2, 3, 1))  # the same training images
    assert torch.equal(train["labels"], bundle.train.labels) and train["classes"] == ["cat", "dog", "frog"]
    held_out = airbench_peer.pack(str(tmp_path / "train"), None, tmp_path / "work2", cache)
    test = torch.load(tmp_path / "work2" / "cifar10" / "test.pt", weights_only=True)
    assert held_out["test_images"] == 3 and torch.equal(test["labels"], bundle.val.labels)


def test_airbench_output_is_kept_and_forwarded(capsys: pytest.CaptureFixture[str]) -> None:
    tee = airbench_peer._Tee()
    with contextlib.redirect_stdout(tee):
        print("| run | epoch |")
    assert tee.getvalue() == "| run | epoch |\n" and capsys.readouterr().err == "| run | epoch |\n"


def test_table_and_metrics_summary(tmp_path: Path) -> None:
    records = [
        {"step": 10, "images_per_s": 1000.0},
        {"step": 20, "images_per_s": 3000.0},
        {"step": 30, "images_per_s": 4000.0},
        {"step": 43, "val_acc": 0.5, "elapsed_s": 2.0},
        {"step": 86, "val_acc": 0.93, "elapsed_s": 19.5, "tta": "flip_translate"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = airbench_peer.metrics_summary(tmp_path)
    assert summary == {"val_acc": 0.93, "train_s": 19.5, "epochs": 2, "tta": "flip_translate", "images_per_s": 3500.0}
    rows = [
        {"name": "fast93.yaml", "test_acc": 0.9312, "train_s": 19.5, "images_per_s": 98765.4, "command_s": 33.0},
        {"name": "airbench96", "error": "timed out after 150 s"},
    ]
    table = airbench_peer.render_table(rows, {"test_images": 10000, "test_source": "t", "train_images": 45000})
    assert "| fast93.yaml | 93.12% | 19.5 | 98,765 | 33.0 |  |" in table
    assert "| airbench96 | -% | - | - | - | timed out after 150 s |" in table
    assert "10,000 images (t)" in table and "same 45,000 images" in table
