"""Shared helpers for end-to-end tests: run the real launcher with bounded time, compare runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import torch

from tests.conftest import launcher_argv, run_proc
from torchlaunch.core import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[1]


def launcher(args: list[str], timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m launch.local ARGS` from the repo root, as a CompletedProcess (conftest.run_proc: its own
    process group, killed whole and the test failed on timeout)."""
    return run_proc(launcher_argv("torchlaunch.agent", *args), timeout=timeout, env=env)


def final_state(run_dir: Path) -> dict:
    found = ckpt.find_latest(Path(run_dir) / "checkpoints")
    assert found is not None, f"no valid checkpoint in {run_dir}"
    return found[1]


def assert_states_equal(a: dict, b: dict) -> None:
    """Model, optimizer and grad-scaler state identical bit for bit."""
    assert a["progress"]["global_step"] == b["progress"]["global_step"]
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), f"model tensor {key} differs"
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys()
    for pid in opt_a:
        for name, value in opt_a[pid].items():
            other = opt_b[pid][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (
                f"optimizer state {pid}/{name} differs"
            )
    assert a["scaler"] == b["scaler"]
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


def assert_models_equal(path_a: Path, path_b: Path) -> None:
    """Two saved models (model.pt) the same bit for bit, every tensor (loaded on the CPU)."""
    a = torch.load(path_a, weights_only=True, map_location="cpu")
    b = torch.load(path_b, weights_only=True, map_location="cpu")
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"tensors differ between {path_a} and {path_b}: {different[:5]}"


def leave_spawned_rank() -> NoReturn:
    """End a rank a test spawned (torch.multiprocessing) as the project's own ranks end
    (runner.exit_process): output flushed, no interpreter teardown, where gloo's C++ threads still
    winding down sometimes abort a finished rank ("terminate called without an active exception",
    SIGABRT: seen in CI on one of three ranks after a clean finish)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def small_trainer(run_dir: Path):  # noqa: ANN201 - a worker Trainer (its import is torch's and the worker's)
    """The smoke recipe's Trainer in this process, one rank, 64 synthetic images of a width-4 CNN: for
    tests of what a rank does with its state (no process group, nothing launched)."""
    from torchlaunch import config as config_mod
    from torchlaunch.core.dist import DistContext
    from torchlaunch.core.preemption import PreemptionWatcher
    from torchlaunch.worker.data import load_bundle
    from torchlaunch.worker.trainer import Trainer

    overrides = [
        f"run_dir={run_dir}",
        "data.synthetic_train_size=64",
        "data.synthetic_val_size=16",
        "train.batch_size=16",
        "model.width=4",
    ]
    cfg = config_mod.load("configs/smoke.yaml", overrides)
    return Trainer(cfg, DistContext(), load_bundle(cfg.data), PreemptionWatcher([]))
