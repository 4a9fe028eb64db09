"""A model plug-in whose forward takes as long as the test says (tests only).

`model.name=tests.programs.slow_model:net`: the built-in simple_cnn, and each forward first sleeps
TORCHLAUNCH_TEST_FORWARD_S seconds (0 when unset). The sleep stands for a slow model or a busy device:
it changes no number, so a run with it and a run without it train the same weights, and a test can
interrupt long steps and compare the resumed run with a fast uninterrupted one. A value `@PATH` names a
file holding the seconds, read when the model is built: a test whose job is requeued with the environment
it was submitted with (Slurm) rewrites the file to 0 once the stop is taken, so the resumed run is fast."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from torchlaunch.worker.models import build_model

FORWARD_S_ENV = "TORCHLAUNCH_TEST_FORWARD_S"


class Slow(nn.Module):
    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return self.inner(x)


def forward_seconds() -> float:
    """TORCHLAUNCH_TEST_FORWARD_S: seconds, or `@PATH` of a file that holds them (0 when unset)."""
    value = os.environ.get(FORWARD_S_ENV) or "0"
    if value.startswith("@"):
        with open(value[1:]) as f:
            value = f.read().strip() or "0"
    return float(value)


def net(num_classes: int, width: int = 16) -> nn.Module:
    return Slow(build_model("simple_cnn", num_classes, width), forward_seconds())
