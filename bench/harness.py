"""Build the project's real Trainer in-process (single rank) for step-level benchmarks."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence

import torch
from torch import nn

from torchlaunch import config as config_mod
from torchlaunch.core.dist import DistContext
from torchlaunch.core.preemption import PreemptionWatcher
from torchlaunch.worker.data import DataBundle, load_bundle
from torchlaunch.worker.trainer import Trainer


def make_trainer(overrides: Sequence[str], bundle: DataBundle | None = None) -> Trainer:
    """A Trainer exactly as the worker builds it, minus the process group (one rank)."""
    run_dir = tempfile.mkdtemp(prefix="bench-run-")
    cfg = config_mod.load(None, [f"run_dir={run_dir}", "debug.check_model=false", *overrides])
    data = bundle if bundle is not None else load_bundle(cfg.data)
    return Trainer(cfg, DistContext(), data, PreemptionWatcher([]))


def bare_step_fn(
    model: nn.Module,
    amp_dtype: torch.dtype | None,
    lr: float = 0.1,
    momentum: float = 0.9,
    nesterov: bool = True,
    weight_decay: float = 5e-4,
    label_smoothing: float = 0.0,
):
    """The textbook PyTorch step (autocast, backward, SGD step, zero_grad): the baseline loop."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model.train()
        if amp_dtype is None:
            loss = criterion(model(x), y)
        else:
            with torch.autocast("cpu", dtype=amp_dtype):
                loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
