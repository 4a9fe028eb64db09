"""Debugging aids for the classic pitfalls, turning deep stack traces into one actionable line.

- `check_model_io`: one fake batch through the model at start-up, so a head that does not match the
  input size, or a layer left on the wrong device, fails in a second with the layer's name instead
  of an hour into a queued job with "mat1 and mat2 shapes cannot be multiplied".
- `anomaly_detection`: the `debug.detect_anomaly` switch (finds the op that produced a NaN; slow).
- `describe_oom`: what to change when CUDA runs out of memory, naming the config keys.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from torchlaunch.exit_codes import BadInput

_DEVICE_MISMATCH_MARKERS = (
    "expected all tensors to be on the same device",
    "input type (",  # "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor)"
    "found at least two devices",
    "expected device",
)


# --------------------------------------------------------------------------- model check


def check_model_io(
    model: nn.Module,
    sample_shape: Sequence[int],
    num_classes: int,
    device: torch.device | str,
    batch_size: int = 2,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> None:
    """Push one fake batch through `model` (before DDP/compile) and check the output shape.

    `sample_shape` is one sample's shape without the batch dimension, e.g. (3, 32, 32).
    Runs in eval mode under no_grad with a private generator, so BatchNorm statistics and the
    global RNG are untouched and a checked run stays bit-identical to an unchecked one. Raises
    BadInput with one line naming the failing layer and the shape it expects.
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn((batch_size, *sample_shape), generator=generator)
    if batch.dim() == 4:
        batch = batch.contiguous(memory_format=memory_format)
    batch = batch.to(device)
    running: list[tuple[str, nn.Module, tuple[Any, ...]]] = []

    def enter(name: str) -> Any:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            running.append((name, module, inputs))

        return hook

    def leave(_module: nn.Module, _inputs: tuple[Any, ...], _output: Any) -> None:
        running.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name or "<model>")))
        handles.append(module.register_forward_hook(leave))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(batch)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        if is_oom(exc):
            raise
        raise BadInput(_explain_failure(exc, running, tuple(batch.shape))) from exc
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    expected = (batch_size, num_classes)
    shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
    if shape != expected:
        got = shape if shape is not None else type(output).__name__
        raise BadInput(
            f"model check: output is {got} for a batch of {batch_size} but the trainer expects "
            f"(batch, num_classes) = {expected} (build the model with num_classes={num_classes}, "
            "the dataset's class count, and return plain logits)"
        )


def _explain_failure(
    exc: BaseException, running: list[tuple[str, nn.Module, tuple[Any, ...]]], batch_shape: tuple
) -> str:
    """One line: which layer, what it got, what it expects, how to fix it."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    sample = "x".join(str(d) for d in batch_shape[1:])
    if not running:
        return f"model check: the model failed on a {sample} sample: {first_line}"
    name, module, inputs = running[-1]
    layer = f"layer '{name}' ({_short_repr(module)})"
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    got = ", ".join(str(tuple(t.shape)) for t in tensors) or "no tensor"
    if _is_device_mismatch(first_line):
        param_devices = sorted({str(p.device) for p in module.parameters(recurse=False)})
        input_devices = sorted({str(t.device) for t in tensors})
        return (
            f"model check: {layer} has parameters on {', '.join(param_devices) or 'no device'} "
            f"but its input is on {', '.join(input_devices) or 'no device'} (move the whole model "
            "with model.to(device) before DDP, and create tensors in forward() on the input's "
            "device)"
        )
    expects = _expected_input(module)
    if expects:
        return (
            f"model check: {layer} expects input {expects} but got {got} for a {sample} sample "
            "(the layer does not match the input size: set data.image_size to the size the "
            "model was built for, or end the features with adaptive pooling)"
        )
    return f"model check: {layer} failed on input {got} for a {sample} sample: {first_line}"


def _is_device_mismatch(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in _DEVICE_MISMATCH_MARKERS)


def _short_repr(module: nn.Module) -> str:
    text = repr(module).splitlines()[0]
    return text if len(text) <= 80 else text[:77] + "..."


def _expected_input(module: nn.Module) -> str | None:
    """The input shape a layer accepts, for the layers whose shape errors are classic."""
    if isinstance(module, nn.Linear):
        return f"(*, {module.in_features})"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        spatial = ", ".join(["*"] * (module.weight.dim() - 2))
        return f"(N, {module.in_channels}, {spatial})"
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return f"(N, {module.num_features}, ...)"
    if isinstance(module, nn.LayerNorm):
        return f"(*, {', '.join(str(d) for d in module.normalized_shape)})"
    return None


# --------------------------------------------------------------------------- anomaly detection


@contextlib.contextmanager
def anomaly_detection(enabled: bool) -> Iterator[None]:
    """torch.autograd.detect_anomaly when `debug.detect_anomaly=true`; a no-op otherwise.

    It re-runs the backward graph with checks and keeps forward traces, typically several times
    slower, so it warns: use it to find the op that makes a NaN, then switch it off.
    """
    if not enabled:
        yield
        return
    warnings.warn(
        "debug.detect_anomaly=true: autograd anomaly detection is on; training is several times "
        "slower (set debug.detect_anomaly=false once the NaN's origin is found)",
        RuntimeWarning,
        stacklevel=3,
    )
    with torch.autograd.detect_anomaly(check_nan=True):
        yield


# --------------------------------------------------------------------------- out of memory


def is_oom(exc: BaseException) -> bool:
    """CUDA (or other accelerator) out-of-memory, however torch chose to raise it."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def describe_oom(
    exc: BaseException,
    *,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    micro_batch_size: int | None = None,
    world_size: int = 1,
    precision: str | None = None,
    channels_last: bool | None = None,
    last_checkpoint: str | None = None,
) -> str:
    """A multi-line report: what ran out, the allocator summary, and the options as overrides."""
    where = f" on {device}" if device is not None else ""
    per_rank = micro_batch_size or (-(-batch_size // world_size) if batch_size else None)  # the largest share
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lines = [f"out of memory{where}: {first}"]
    if per_rank:
        lines.append(
            f"batch: {per_rank} images per rank per forward pass, global batch "
            f"{batch_size if batch_size is not None else '?'} on {world_size} rank(s)"
        )
    lines.append(_memory_summary(device))
    lines.append("options (each keeps the global batch, so results stay comparable):")
    smaller = _smaller_micro_batch(batch_size, per_rank, world_size)
    if smaller is not None and batch_size is not None:
        largest_share = -(-batch_size // world_size)
        steps = -(-largest_share // smaller)
        lines.append(
            f"  - smaller per-rank batch with gradient accumulation: train.micro_batch_size="
            f"{smaller} (train.batch_size={batch_size} unchanged, {steps} micro-batches per step)"
        )
    else:
        lines.append(
            "  - smaller per-rank batch with gradient accumulation: lower "
            "train.micro_batch_size, keeping train.batch_size"
        )
    if precision == "bf16":
        lines.append("  - bf16 is already on (train.precision=bf16)")
    else:
        lines.append("  - bf16 autocast, about half the activation memory: train.precision=bf16")
    if channels_last:
        lines.append("  - channels_last is already on (train.channels_last=true)")
    else:
        lines.append("  - channels_last memory format: train.channels_last=true")
    kept = f" ({last_checkpoint})" if last_checkpoint else ""
    lines.append(
        f"the last good checkpoint is kept{kept}: rerun the same command with one of these "
        "overrides and it resumes from there"
    )
    return "\n".join(lines)


def _smaller_micro_batch(batch_size: int | None, per_rank: int | None, world_size: int) -> int | None:
    """Half the current per-rank batch: any micro-batch size works (the plan splits every share into
    the same number of passes), so halving halves the activation memory."""
    if not batch_size or not per_rank or per_rank < 2:
        return None
    return per_rank // 2


def _memory_summary(device: torch.device | str | None) -> str:
    if device is not None and torch.device(device).type != "cuda":
        return "(no CUDA memory summary: the device is not a GPU)"
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return "(no CUDA memory summary: CUDA is not initialised in this process)"
    try:
        return torch.cuda.memory_summary(device, abbreviated=True)
    except RuntimeError as exc:  # the allocator itself may be in a bad state after an OOM
        return f"(memory summary unavailable: {exc})"
