"""Lookahead averaging (airbench's "lookahead EMA"): every N optimizer steps the weights are pulled
toward a slow average and the average is copied back into the model, with a pull that grows toward
the end of the run; the final step leaves the model on the average.

Why: short high-LR schedules end on noisy weights; averaging the last stretch gains accuracy at no
cost in steps. The average is part of the checkpoint, so a resumed run continues it bit for bit."""

from __future__ import annotations

import torch
from torch import nn


class Lookahead:
    """The slow copy of every floating-point entry of the model's state (weights and BN statistics)."""

    def __init__(self, model: nn.Module, every: int, decay: float, total_steps: int) -> None:
        self.model, self.every, self.decay, self.total_steps = model, every, decay, max(1, total_steps)
        live = self._float_state()
        self.average = {k: v.detach().clone() for k, v in live.items()}
        # The live tensors, fixed once: load_state_dict and the optimizer update them in place. The
        # update is two foreach calls on host-side numbers (no per-tensor loop, no device sync).
        self._live = list(live.values())
        self._avg = [self.average[k] for k in live]

    def _float_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if v.is_floating_point()}

    def after_step(self, global_step: int) -> None:
        """Call after every optimizer step with the number of steps done so far."""
        if global_step >= self.total_steps:
            self._update(1.0)  # end of the run: the model becomes the average
        elif global_step % self.every == 0:
            self._update(self.decay * (global_step / self.total_steps) ** 3)

    @torch.no_grad()
    def _update(self, keep: float) -> None:
        torch._foreach_lerp_(self._avg, self._live, 1.0 - keep)
        torch._foreach_copy_(self._live, self._avg)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.average)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.average) ^ set(state)
        if missing:
            raise KeyError(f"lookahead state does not match the model: {sorted(missing)[:3]}")
        with torch.no_grad():
            for key, value in state.items():
                self.average[key].copy_(value)
