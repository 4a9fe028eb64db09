"""The one registry of data formats: every question about a `data.name` is asked here.

Why: a format used to be dispatched by name in the reader (`load_bundle`), the launchers' pre-check,
evaluation and the config's GPU-decode rule, so a new format silently broke the pre-check or
evaluation. Now a format is one `register(DataFormat(...))` call and every call site asks `get(name)`.

This module imports neither torch nor the worker: the launch side (torchlaunch.launch.precheck) and
the config read it. A format's reader and evaluation set may import torch; they are only called in
a rank (`lazy` keeps a built-in entry from importing its module before then).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import ConfigError

DataConfig = Any
"""The run's data section (torchlaunch.data.section.data_config()): composed from the registered
formats' own sections, so it has no static type here."""

PLUGIN = "pkg.module:factory"
"""The key of the plug-in format: every `data.name` that is an import path (has a colon) is read by it."""
DEFAULT_FOLDER = "imagefolder"
"""Evaluation's `--data-name auto`: a folder that no format's `detect` claims is read as class folders."""
ROOT_USES = ("required", "optional", "unused")


@dataclass(frozen=True)
class DataFormat:
    """Everything the package needs to know about one data format, registered once."""

    name: str
    load: Callable[[DataConfig], Any]
    """The reader: the run's DataConfig -> DataBundle (train, val, classes). Runs in a rank (may import torch)."""
    precheck: Callable[[DataConfig, bool], None] | None = None
    """Torch-free check run by the launchers before any rank starts: raise BadInput with the line the
    worker would print. Called as precheck(cfg, local); a root this host cannot see is not judged when
    local=False (the job runs elsewhere). None: nothing to check before the ranks read it."""
    eval_set: Callable[[DataConfig, str], tuple[Any, list[str]]] | None = None
    """(images, class names) that `train.evaluate` scores: a folder of this format at cfg.root, split
    "all" or "val". None: this format cannot be evaluated from a folder (synthetic)."""
    detect: Callable[[Path], bool] | None = None
    """Evaluation's `--data-name auto`: does this folder hold this format? (None: never claimed.)"""
    held_out: tuple[str, ...] = ()
    """Evaluation splits for which the run's own recorded data.root is held out from training by the
    format's layout, so no --data-root is needed (a shard set's val/, CIFAR-10's test batch)."""
    own_val: bool = False
    """Evaluation reads the format's own val split through its reader, data.root optional (a plug-in)."""
    gpu_decode: bool = False
    """data.decode=gpu can decode this format's JPEGs (its reader hands on encoded bytes)."""
    root: str = "required"
    """How data.root is used: required, optional (passed on when set) or unused (generated data)."""
    summary: str = ""
    """A few words for messages, e.g. "generated images"."""
    validate: Callable[[DataConfig], None] | None = None
    """Config checks of this format's own keys (raise ConfigError), run by torchlaunch.config.validate."""
    options: type | None = None
    """This format's own config section: a dataclass whose fields (each with its rule in its metadata,
    torchlaunch.base.rules, and a docstring under it) are the format's keys, flat under `data.`
    (data.download, data.shard_label). torchlaunch.data.section joins them with the shared keys; a key
    another section already has is refused there. None: the format has no keys of its own."""


_FORMATS: dict[str, DataFormat] = {}


def register(fmt: DataFormat) -> DataFormat:
    """Add a format (a third-party package calls this at import); a name already taken is refused."""
    if fmt.root not in ROOT_USES:
        raise ValueError(f"DataFormat.root must be one of {ROOT_USES}, got {fmt.root!r}")
    if fmt.name in _FORMATS:
        raise ValueError(f"data format {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format (tests that register a fake one)."""
    _FORMATS.pop(name, None)


def names(*, gpu_decode: bool | None = None, evaluable: bool = False) -> tuple[str, ...]:
    """Registered names a user types as data.name (the plug-in key excluded), in registration order;
    gpu_decode=True: only those data.decode=gpu reads; evaluable: only those with an evaluation folder."""
    return tuple(
        f.name
        for f in _FORMATS.values()
        if f.name != PLUGIN
        and (gpu_decode is None or f.gpu_decode == gpu_decode)
        and (not evaluable or (f.eval_set is not None and not f.own_val))
    )


def get(name: str) -> DataFormat:
    """The format of a data.name; an unknown name is a ConfigError (exit 2) listing the registered ones."""
    key = PLUGIN if ":" in str(name) else str(name)
    fmt = _FORMATS.get(key)
    if fmt is None:
        raise ConfigError(
            "data.name", f"unknown value {quote(name)}", f"choose one of: {', '.join([*names(), PLUGIN])}"
        )
    return fmt


def options() -> tuple[type, ...]:
    """The config sections of the registered formats, in registration order (torchlaunch.data.section)."""
    return tuple(f.options for f in _FORMATS.values() if f.options is not None)


def detect(root: Path) -> str:
    """The name of the format a folder holds, for evaluation's `--data-name auto`."""
    for fmt in _FORMATS.values():
        if fmt.detect is not None and fmt.detect(root):
            return fmt.name
    return DEFAULT_FOLDER


def lazy(path: str) -> Callable[..., Any]:
    """`module:function`, imported at the first call: a built-in entry names its reader without
    importing torch into the launcher that only reads the registry."""
    module, _, attr = path.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__qualname__ = call.__name__ = path
    return call
