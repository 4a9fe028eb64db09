"""A run written by the code before everything moved under torchlaunch/ resumes and evaluates unchanged.

tests/fixtures/premove_smoke holds what that code (commit d73c5b6, top-level `train` package) wrote for
a tiny smoke run: its resolved config.yaml and the epoch-1 checkpoint (step 4 of 8); expected.json
says how it was made, the old run's validation at step 4 and the digests of the final weights of the
old run's uninterrupted 8 steps. A checkpoint is data: it must not name the old modules anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickletools
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cmd
from torchlaunch import config as config_mod
from torchlaunch.core import checkpoint as ckpt

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "premove_smoke"
CHECKPOINT = FIXTURE / "checkpoints" / "step-000000004"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def digests(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16] for k, v in state_dict.items()}


def old_tree(tmp_path: Path) -> Path:
    """The old commit's files (`git archive`), or a skip where git history is not at hand (a shallow clone)."""
    import subprocess
    import tarfile

    from tests.conftest import REPO

    commit = EXPECTED["old_commit"]
    probe = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"commit {commit[:7]} is not in this checkout's history (a shallow clone)")
    old, archive = tmp_path / "old", tmp_path / "old.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), commit], check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(old, filter="data")
    return old


def run_old(old: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """`python -m train ARGS` of the old code, with only it on PYTHONPATH (nothing of ours)."""
    env = {**os.environ, "PYTHONPATH": str(old), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "train", *args], cwd=old, env=env, capture_output=True, text=True, timeout=240
    )


def pickled_modules(path: Path) -> set[str]:
    """The modules whose names the checkpoint's pickle refers to (GLOBAL and STACK_GLOBAL opcodes)."""
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        data = archive.read(name)
    modules: set[str] = set()
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            modules.add(str(arg).split(" ")[0])
        elif opcode.name == "STACK_GLOBAL":
            modules.add(strings[-2])
        if isinstance(arg, str):
            strings.append(arg)
    return modules


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_new_code_resumes_the_old_run_to_the_old_runs_exact_weights(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    (run_dir / "expected.json").unlink()
    rc, out, err = run_cmd(
        [sys.executable, "-m", "train", "--config", str(run_dir / "config.yaml"), f"run_dir={run_dir}"],
        timeout=150,
        env={"OMP_NUM_THREADS": "1"},  # as the fixture was made
    )
    assert rc == 0, err[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step-000000004'}" in out, out
    assert "finished: 8 steps" in out
    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_acc" in line]
    assert final[-1]["step"] == 8 and final[-1]["val_acc"] == EXPECTED["final_validation"]["val_acc"]
    assert final[-1]["val_loss"] == pytest.approx(EXPECTED["final_validation"]["val_loss"], rel=1e-5)
    # Bit for bit against the old code resuming the same checkpoint on this CPU (the fixture's own digests
    # hold only on the CPU model it was made on: other models' kernels sum floats in another order).
    old = old_tree(tmp_path)
    old_run = tmp_path / "old-run"
    shutil.copytree(FIXTURE, old_run)
    (old_run / "expected.json").unlink()
    result = run_old(old, ["--config", str(old_run / "config.yaml"), f"run_dir={old_run}"])
    assert result.returncode == 0, result.stderr[-3000:]
    new_weights = torch.load(run_dir / "model.pt", weights_only=True)
    old_weights = torch.load(old_run / "model.pt", weights_only=True)
    assert digests(new_weights) == digests(old_weights)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_new_evaluate_scores_the_old_checkpoint_as_the_old_run_did(tmp_path: Path) -> None:
    """The old run's own validation images, written as a folder of class folders (PNG is lossless)."""
    from PIL import Image

    from torchlaunch.worker.data import make_synthetic

    cfg = config_mod.load(FIXTURE / "config.yaml", [f"run_dir={tmp_path / 'unused'}"])
    bundle = make_synthetic(cfg.data)
    images = tmp_path / "val"
    for i, (image, label) in enumerate(zip(bundle.val.images, bundle.val.labels.tolist(), strict=True)):
        folder = images / bundle.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i:03d}.png")
    rc, out, err = run_cmd(
        [
            sys.executable,
            "-m",
            "torchlaunch.worker.evaluate",
            "--checkpoint",
            str(CHECKPOINT),
            "--data-root",
            str(images),
        ],
        timeout=150,
    )
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    old = EXPECTED["step4_validation"]
    assert result["step"] == 4 and result["samples"] == cfg.data.synthetic_val_size
    assert result["accuracy"] == old["val_acc"]  # the same images counted right: exact
    assert result["loss"] == pytest.approx(old["val_loss"], rel=1e-5)  # summed in another order


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fixture_is_what_the_old_code_writes(tmp_path: Path) -> None:
    """Where git history is at hand (CI clones it): the old commit, run again, writes the fixture's step-4
    weights (the fixture is not hand-made): bit for bit on the CPU model it was made on, within float32
    rounding (measured: <= 6e-7 relative) on another, whose kernels sum in another order."""
    old, run_dir = old_tree(tmp_path), tmp_path / "run"
    result = run_old(old, ["--config", "configs/smoke.yaml", f"run_dir={run_dir}", *EXPECTED["overrides"]])
    assert result.returncode == 0, result.stderr[-3000:]
    written = torch.load(run_dir / "checkpoints" / CHECKPOINT.name / "state.pt", weights_only=True)
    fixture = ckpt.load_state(CHECKPOINT, "cpu")
    for name, tensor in fixture["model"].items():  # bit for bit on the fixture's CPU model (see above)
        torch.testing.assert_close(written["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
