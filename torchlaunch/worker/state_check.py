"""Is a loaded checkpoint of the built-in worker one it can continue from: keys and types, before any
of it is applied.

A state whose checksum matches may still be unusable (written by a program that mis-filled it, edited
by hand, or forged with a valid checksum); checked here, it is skipped for the previous checkpoint like
a corrupt one, instead of failing with a traceback at every retry. A state that is well-formed but does
not fit the config (another model, another optimizer) stays bad input, in Trainer.load_state_dict.
"""

from __future__ import annotations

from typing import Any

import torch

PROGRESS = {"epoch": int, "step_in_epoch": int, "global_step": int, "val_pending": bool}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def worker_state_problem(state: dict[str, Any]) -> str | None:
    """Why the worker cannot continue from `state`, or None."""
    model = state.get("model")
    if not isinstance(model, dict) or not model or not all(isinstance(v, torch.Tensor) for v in model.values()):
        return "`model` is missing or not a mapping of tensors"
    optimizer = state.get("optimizer")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("param_groups"), list):
        return "`optimizer` is missing or not an optimizer state_dict"
    for key in ("scheduler", "scaler"):
        if not isinstance(state.get(key), dict):
            return f"`{key}` is missing or not a mapping"
    progress = state.get("progress")
    if not isinstance(progress, dict):
        return "`progress` is missing or not a mapping"
    for key, kind in PROGRESS.items():
        value = progress.get(key)
        if (kind is int and not (_is_int(value) and value >= 0)) or (kind is bool and not isinstance(value, bool)):
            return f"`progress.{key}` is missing or not {'a count' if kind is int else 'true/false'}"
    best = progress.get("best_val_acc")
    if best is not None and not isinstance(best, int | float):
        return "`progress.best_val_acc` is not a number"
    if not isinstance(progress.get("last_val"), dict):
        return "`progress.last_val` is missing or not a mapping"
    if "step" in state and state["step"] != progress["global_step"]:
        return f"its step {state['step']} is not its progress.global_step {progress['global_step']}"
    if not _is_int(state.get("global_batch")):
        return "`global_batch` is missing or not an integer"
    return None
