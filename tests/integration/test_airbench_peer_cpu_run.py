"""bench.gpu --peer-airbench without a GPU: the packed files in airbench's format (checked by airbench's own
loader, imported from the carried wheel), the table, the metrics summary and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import airbench_peer
from tests.conftest import REPO, child_env, error_lines, run_module
from tests.unit.test_data import write_folder

CLASSES = {"cat": 12, "dog": 12, "frog": 6}


CHILD = """
import sys, torch
import airbench
from airbench import utils
loader = airbench.CifarLoader(sys.argv[1], train=True, batch_size=8, aug=dict(flip=True, translate=4, cutout=12),
                              altflip=True, gpu='cpu')
x, y = next(iter(loader))
test = airbench.CifarLoader(sys.argv[1], train=False, batch_size=2000, gpu='cpu')
print('batch', tuple(x.shape), x.dtype, tuple(y.shape), y.dtype, len(test.labels), test.classes[0])
utils.print_columns(utils.logging_columns_list, is_head=True)
utils.print_training_details({'run': 0, 'epoch': 3, 'train_loss': 0.5, 'train_acc': 0.8, 'val_acc': 0.9,
                              'total_time_seconds': 1.5}, is_final_entry=False)
utils.print_training_details({'epoch': 'eval', 'tta_val_acc': 0.9327, 'total_time_seconds': 19.9},
                             is_final_entry=True)
"""


def test_airbench_loads_the_packed_files_and_its_table_parses(tmp_path: Path) -> None:
    write_folder(tmp_path / "train", CLASSES, size=32)
    airbench_peer.pack(str(tmp_path / "train"), None, tmp_path, str(tmp_path / "cache"))
    env = child_env({"PYTHONPATH": f"{airbench_peer.WHEEL}"})
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "cifar10")], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "batch (8, 3, 32, 32) torch.float16 (8,) torch.int64 3 cat" in out.stdout
    assert airbench_peer.parse_airbench_table(out.stdout) == {"tta_val_acc": 0.9327, "total_time_seconds": 19.9}


def test_command_line(tmp_path: Path) -> None:
    rc, out, _ = run_module("bench.gpu", ["--help"])
    assert rc == 0 and "--peer-airbench" in out and "--test-root" in out and "--pack-only" in out
    rc, _, err = run_module("bench.gpu", ["--peer-airbench"])
    assert rc == 2 and error_lines(err) == [
        "bench error: --peer-airbench needs --data-root (the unpacked CIFAR-10 train/ folder)"
    ]
    write_folder(tmp_path / "train", CLASSES, size=32)
    rc, _, err = run_module(
        "bench.gpu",
        [
            "--peer-airbench",
            "--pack-only",
            "--data-root",
            str(tmp_path / "train"),
            "--test-root",
            str(tmp_path / "nope"),
            "--work-dir",
            str(tmp_path / "w"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
    )
    assert rc == 2 and len(error_lines(err)) == 1 and "--test-root" in err and "is not a folder" in err
    rc, out, err = run_module(
        "bench.gpu",
        [
            "--peer-airbench",
            "--pack-only",
            "--data-root",
            str(tmp_path / "train"),
            "--work-dir",
            str(tmp_path / "w"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
    )
    assert rc == 0, err
    assert json.loads(out.splitlines()[-1])["shapes"] == {"train": [27, 32, 32, 3], "test": [3, 32, 32, 3]}


@pytest.mark.slow
@pytest.mark.extended  # a benchmark peer's smoke
def test_project_side_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    """The whole call without a GPU (no peers): both recipes plus an --extra run train on the packed split,
    are evaluated on --test-root, and land in the table and the JSON written after every run."""
    write_folder(tmp_path / "train", CLASSES, size=32)
    write_folder(tmp_path / "test", {"cat": 3, "dog": 2, "frog": 4}, size=32, seed=1)
    out = tmp_path / "out"
    rc, stdout, err = run_module(
        "bench.gpu",
        [
            "--peer-airbench",
            "--peers",
            "--data-root",
            str(tmp_path / "train"),
            "--test-root",
            str(tmp_path / "test"),
            "--work-dir",
            str(tmp_path / "w"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out-dir",
            str(out),
            "--project-overrides",
            "model.width=8",
            "train.epochs=1",
            "train.batch_size=8",
            "--extra",
            "fast93.yaml:train.epochs=2",
        ],
        timeout=300,
    )
    assert rc == 0, err[-3000:]
    report = json.loads((out / "peer-airbench.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == ["fast.yaml", "fast93.yaml", "fast93.yaml train.epochs=2"]
    assert runs["fast93.yaml train.epochs=2"]["epochs"] == 2 and runs["fast93.yaml"]["epochs"] == 1
    for r in runs.values():
        assert 0.0 <= r["test_acc"] <= 1.0 and r["train_s"] > 0 and r["images_per_s"] > 0 and "error" not in r
        assert r["run_dir"].startswith(str(tmp_path / "w" / "runs"))
    assert report["packed"]["test_images"] == 9 and report["packed"]["train_images"] == 27
    assert (out / "peer-airbench.md").read_text().strip() in stdout
    assert "| fast93.yaml train.epochs=2 |" in stdout


def test_session_script_refuses_missing_data_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        ["bash", "bench/gpu_session.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env({"GPU_DATA": str(tmp_path / "none"), "OUT": str(tmp_path / "out")}),
    )
    assert out.returncode == 2 and out.stdout == ""
    assert error_lines(out.stderr) == [
        f"gpu_session: {tmp_path / 'none'}/cifar10-train.tar.gz is missing (copy "
        f"/work/shared/data/cifar10-train.tar.gz there and carry {tmp_path / 'none'})"
    ]
    assert subprocess.run(["bash", "-n", "bench/gpu_session.sh"], cwd=REPO, timeout=30).returncode == 0
