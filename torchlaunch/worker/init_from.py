"""`model.init_from`: start a fresh run from existing weights (fine-tuning, a new head, a warm start).

Why its own module: finding the weights (a run folder, a checkpoint folder, a plain `.pt`), loading
them safely (weights_only on CPU, checkpoints verified by the checkpoint store) and matching them to
a model (strict, or listing everything that did not fit) is one job, used once at the start of a run.
Which checkpoint a path means, and whether this run has one of its own, is the store's answer
(ckpt.locate, ckpt.latest_valid), the same one resume and evaluation use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchlaunch import rundir
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.exit_codes import BadInput, ConfigError

KEY = "model.init_from"
FORMS = "a run folder, a checkpoint folder RUN_DIR/checkpoints/step-NNNNNNNNN, or a .pt file holding a state_dict"
_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers


def _bad(problem: str, fix: str = f"point it at {FORMS}") -> BadInput:
    return ConfigError(KEY, problem, fix)


def locate(text: str) -> Path:
    """The path, checked to exist (cheap: the worker's early check, before data is loaded)."""
    path = Path(text).expanduser()
    if not path.exists():
        raise _bad(f"{path} does not exist")
    if not (path.is_file() or path.is_dir()):  # a device (/dev/zero), FIFO or socket: never read
        raise _bad(f"{path} is not a regular file or a folder")
    return path


def _from_checkpoint_folder(path: Path) -> dict[str, Any]:
    try:
        state = ckpt.load_state(path, "cpu")
    except ckpt.InvalidCheckpoint as e:
        raise _bad(f"{path} is not a valid checkpoint: {e}", "pick another checkpoint") from None
    if not isinstance(state.get("model"), Mapping):
        raise _bad(f"{path} holds no model state", "pick a checkpoint of the built-in worker")
    return state["model"]


def _from_file(path: Path) -> dict[str, Any]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unreadable, truncated or refused by the safe loader
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _bad(f"cannot load {path} with weights_only=True: {first[:160]}") from None
    if isinstance(obj, Mapping) and "format_version" in obj and "model" in obj:
        obj = obj["model"]  # a checkpoint's state.pt copied out of its folder
    elif isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]  # the common {"state_dict": ...} wrapper
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise _bad(
            f"{path} holds a {type(obj).__name__}, not a state_dict of tensors",
            "save it with torch.save(model.state_dict(), PATH)",
        )
    return dict(obj)


def load_weights(text: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file or folder actually read, its model state_dict on CPU with wrapper prefixes removed)."""
    path = locate(text)
    found = ckpt.locate(path)
    assert found is not None  # locate() checked that it exists
    if found.checkpoint is not None:
        source, state = found.checkpoint, _from_checkpoint_folder(found.checkpoint)  # verified via its marker
    elif found.kind == "file":
        source, state = path, _from_file(path)
    elif found.root is not None and (newest := ckpt.latest_valid(found.root)) is not None:
        source, state = newest, _from_checkpoint_folder(newest)
    elif rundir.model(path).is_file():
        source, state = rundir.model(path), _from_file(rundir.model(path))
    else:
        raise _bad(f"{path} holds no valid checkpoint and no model.pt")
    return source, {_strip(k): v for k, v in state.items()}


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        while key.startswith(prefix):
            key = key[len(prefix) :]
    return key


@dataclass
class Match:
    """How a state_dict fits a model."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def counts(self) -> str:
        return (
            f"{len(self.missing)} missing, {len(self.unexpected)} unexpected, "
            f"{len(self.mismatched)} shape-mismatched of the model's {len(self.loaded) + len(self.missing) + len(self.mismatched)} tensors"
        )

    def block(self, source: Path) -> str:
        """The one report printed on rank 0 when init_strict=false: every skipped tensor, named."""
        lines = [f"init_from {source}: loaded {len(self.loaded)} tensors; {self.counts()}"]
        lines += [
            f"  shape mismatch (kept fresh init): {k}: checkpoint {list(a)} vs model {list(b)}"
            for k, a, b in self.mismatched
        ]
        lines += [f"  missing in checkpoint (kept fresh init): {k}" for k in self.missing]
        lines += [f"  unexpected in checkpoint (ignored): {k}" for k in self.unexpected]
        return "\n".join(lines)


def match(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Match:
    own = model.state_dict()
    m = Match()
    for key, value in own.items():
        if key not in state:
            m.missing.append(key)
        elif tuple(state[key].shape) != tuple(value.shape):
            m.mismatched.append((key, tuple(state[key].shape), tuple(value.shape)))
        else:
            m.loaded.append(key)
    m.unexpected = [k for k in state if k not in own]
    return m


def apply(model: nn.Module, text: str, strict: bool) -> str:
    """Load `text`'s weights into `model` in place (copied onto the model's device). Returns the report
    to print on rank 0. Strict and inexact, or nothing that fits: BadInput with one line."""
    source, state = load_weights(text)
    m = match(model, state)
    if not m.exact and strict:
        first = (
            m.mismatched
            and f"e.g. {m.mismatched[0][0]} {list(m.mismatched[0][1])} vs {list(m.mismatched[0][2])}"
            or m.missing
            and f"e.g. missing {m.missing[0]}"
            or f"e.g. unexpected {m.unexpected[0]}"
        )
        raise ConfigError(
            "model.init_strict",
            f"{source} does not match the model: {m.counts()}, {first}",
            "set model.init_strict=false to load what fits and keep the fresh init for the rest, "
            "or init_from weights of the same model.name and class count",
        )
    if not m.loaded:
        raise ConfigError(
            KEY,
            f"none of {source}'s {len(state)} tensors fit the model",
            f"{m.counts()}; init_from weights of the same architecture",
        )
    with torch.no_grad():
        model.load_state_dict({k: state[k] for k in m.loaded}, strict=False)
    if m.exact:
        return f"init_from {source}: loaded all {len(m.loaded)} tensors"
    return m.block(source)


def will_resume(resume: str, ckpt_root: Path, on_skip: ckpt.SkipReport | None = None) -> bool:
    """Whether this start continues the run's own checkpoint (then init_from is not used): an explicit
    checkpoint.resume path, or `auto` with a checkpoint in the run folder that verifies (the one resume
    will load). Folders that do not verify go to on_skip(path, reason) and do not count."""
    if resume == "never":
        return False
    return resume != "auto" or ckpt.latest_valid(ckpt_root, on_skip) is not None


def init_for_run(model: nn.Module, text: str, strict: bool, resume: str, ckpt_root: Path, is_main: bool) -> None:
    """The Trainer's one call: apply init_from on a fresh run (after any data-dependent init such as
    fastnet's whitening stem, so the loaded weights win), or log that a resume ignores it. A run whose
    own checkpoints all fail to verify is a fresh run: init_from applies, with one warning naming them."""
    if not text:
        return
    skipped: list[tuple[Path, str]] = []
    if will_resume(resume, ckpt_root, lambda path, reason: skipped.append((path, reason))):
        if is_main:
            print(f"model.init_from={text} ignored: resuming from this run's own checkpoint", flush=True)
        return
    if skipped and is_main:
        named = "; ".join(f"{path} ({reason})" for path, reason in skipped)
        ckpt.warn(f"no checkpoint of this run verifies: {named}; starting fresh from model.init_from={text}")
    report = apply(model, text, strict)
    if is_main:
        print(report, flush=True)
