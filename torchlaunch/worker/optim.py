"""The recipe's optimizer, parameter groups and LR schedule; optimizers that do not import torch._dynamo.

torch.optim wraps `step` (`_use_grad_for_differentiable`) and `add_param_group`, `zero_grad`,
`state_dict`, `load_state_dict` (`torch._disable_dynamo`) in functions that import torch._dynamo on
first call, only to tell the compiler to keep out. Nothing here is compiled (the step runs eagerly
beside a compiled or plain model), so that import buys nothing, yet it is the largest item of a
worker's start-up: ~1.3 s on the 2-core CPU box, ~5 s on the H200 box. These subclasses
call the very same torch functions without the wrappers: same update, same state_dict layout, same
bits. With model.compile=true the stock classes are used (compile imports torch._dynamo anyway).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchlaunch import compat

if TYPE_CHECKING:
    from torchlaunch.config import RunConfig


undecorated = compat.undecorated


_BASE = torch.optim.Optimizer


class _NoDynamoImport:
    """Mixin placed before a torch optimizer class: the same methods, minus their dynamo wrappers.
    The optimizer step hooks and profiler record still run: torch wraps this class's `step` in them."""

    _torch_class: type[torch.optim.Optimizer]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        undecorated(_BASE.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        undecorated(_BASE.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return undecorated(_BASE.state_dict)(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        undecorated(_BASE.load_state_dict)(self, state_dict)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # torch's wrapper sets grad mode to defaults["differentiable"] (False here) around the step
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):  # type: ignore[attr-defined]
            return undecorated(self._torch_class.step)(self, closure)


class SGD(_NoDynamoImport, torch.optim.SGD):
    """torch.optim.SGD without the torch._dynamo import."""

    _torch_class = torch.optim.SGD


class AdamW(_NoDynamoImport, torch.optim.AdamW):
    """torch.optim.AdamW without the torch._dynamo import."""

    _torch_class = torch.optim.AdamW


def fused_supported(device: torch.device) -> bool:
    """Whether torch has fused SGD/AdamW kernels for this device type (CPU and CUDA do in 2.x)."""
    devices = compat.fused_kernel_devices()
    return device.type in (devices if devices is not None else ("cpu", "cuda"))


def build(
    name: str,
    groups: list[dict[str, Any]],
    device: torch.device,
    eager_only: bool,
    *,
    lr: float,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.Optimizer:
    """SGD or AdamW over `groups`. SGD: fused kernels where torch has them for the device (one kernel
    over all parameters: 3-6x faster optimizer step on CPU, bench/proposals.py), else foreach. AdamW:
    fused on CUDA, foreach elsewhere (its CPU update is kept as it was: same bits on resume).
    `eager_only`: nothing will be compiled, so use the classes that skip the torch._dynamo import."""
    fused = fused_supported(device)
    if name == "adamw":
        cls = AdamW if eager_only else torch.optim.AdamW
        kernel: dict[str, Any] = {"fused": True} if fused and device.type == "cuda" else {"foreach": None}
        return cls(groups, lr=lr, betas=betas, weight_decay=weight_decay, **kernel)
    extra: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    cls = SGD if eager_only else torch.optim.SGD
    return cls(groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, **extra)


def param_groups(cfg: RunConfig, model: nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters; with optim.norm_lr_scale != 1 the BatchNorm ones get their own group
    (LR x scale, weight decay / scale: the same decay per step)."""
    o = cfg.optim
    norm_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for p in m.parameters(recurse=False)
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    if o.norm_lr_scale == 1.0:
        return [{"params": trainable, "lr": o.lr, "weight_decay": o.weight_decay}]
    norms = [p for p in trainable if id(p) in norm_ids]
    others = [p for p in trainable if id(p) not in norm_ids]
    groups = [{"params": others, "lr": o.lr, "weight_decay": o.weight_decay}]
    if norms:
        groups.append({"params": norms, "lr": o.lr * o.norm_lr_scale, "weight_decay": o.weight_decay / o.norm_lr_scale})
    return groups


def build_optimizer(cfg: RunConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The recipe's optimizer over param_groups. Without model.compile it never imports torch._dynamo,
    the largest item of start-up otherwise."""
    o = cfg.optim
    return build(
        o.name,
        param_groups(cfg, model),
        device,
        eager_only=not cfg.model.compile,
        lr=o.lr,
        momentum=o.momentum,
        nesterov=o.nesterov and o.momentum > 0,
        weight_decay=o.weight_decay,
        betas=tuple(o.betas),
    )


def lr_lambda_factory(cfg: RunConfig, steps_per_epoch: int, total_steps: int) -> Callable[[int], float]:
    """The LR multiplier per optimizer step: warmup (from warmup_start_ratio, or (step + 1) / warmup),
    then constant, step decay, linear or cosine down to min_lr_ratio at total_steps."""
    warmup = int(round(cfg.optim.warmup_epochs * steps_per_epoch))
    sched = cfg.optim.schedule

    start = cfg.optim.warmup_start_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return start + (1 - start) * step / warmup if start else (step + 1) / warmup
        if sched == "constant":
            return 1.0
        if sched == "step":
            return cfg.optim.step_gamma ** (step // (cfg.optim.step_epochs * steps_per_epoch))
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        floor = cfg.optim.min_lr_ratio
        if sched == "linear":
            return 1.0 - (1 - floor) * progress
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    cfg: RunConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step; its state (last_epoch) is part of the checkpoint."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_factory(cfg, steps_per_epoch, total_steps))
