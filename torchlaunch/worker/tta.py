"""Test-time augmentation: average a model's logits over mirrored and shifted copies of each batch.

Why: a net trained with flips and translations is nearly invariant to them but not exactly; averaging
its predictions over those views removes part of its error at the cost of 2 or 6 forward passes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LEVELS = ("none", "flip", "flip_translate")


def _mirror_mean(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return 0.5 * model(x).float() + 0.5 * model(x.flip(-1)).float()


def tta_logits(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, level: str) -> torch.Tensor:
    """Logits for batch x (N, C, H, W): `none` one pass, `flip` the mean with the mirror, `flip_translate`
    half that mean and half the mirrored mean of the two diagonal 1-pixel shifts (reflect padded)."""
    if level == "none":
        return model(x).float()
    plain = _mirror_mean(model, x)
    if level == "flip":
        return plain
    if level != "flip_translate":
        raise ValueError(f"unknown TTA level {level!r} (choose one of {', '.join(LEVELS)})")
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = [padded[..., 0:h, 0:w], padded[..., 2 : h + 2, 2 : w + 2]]
    memory_format = (
        torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    )
    views = [_mirror_mean(model, v.contiguous(memory_format=memory_format)) for v in shifted]
    return 0.5 * plain + 0.25 * (views[0] + views[1])
