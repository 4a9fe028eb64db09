"""Plug-ins by import path: the one resolver that `model.name` and `data.name` ask.

Why one place: the worker, train.evaluate, the doctor and the checkpoint must agree on how
`pkg.module:factory` is found (the run's working directory first, then PYTHONPATH), and every way it
can go wrong must end as the same kind of one-line `config error` (exit 2, never retried).

Contracts
---------
`model.name=pkg.module:factory`
    Called as ``factory(num_classes=N)``, plus ``width=W`` only when ``model.width`` is set (non-zero).
    Must return a ``torch.nn.Module`` whose forward maps a float batch (B, 3, S, S), S =
    ``data.image_size``, to logits (B, N).

`data.name=pkg.module:factory`
    Called with the keywords it accepts among ``root`` (= ``data.root``) and ``image_size``
    (= ``data.image_size``); a factory taking neither is called with no arguments. Returns
    ``PluginData(train, val, classes)`` (from this module) or the plain tuple ``(train, val, classes)``:
    - ``train`` and ``val``: map-style datasets (``__len__`` + ``__getitem__``) whose item ``i`` is
      ``(image, label)``; ``image`` is a PIL image (any mode, converted to RGB) or a CHW tensor with 3
      channels, uint8 in [0, 255] or floating point in [0, 1]; ``label`` is an int (or a 0-d integer
      tensor) in ``[0, len(classes))``. Images of another size are resized to ``data.image_size``.
    - ``classes``: the class names, a list of at least 2 strings.
    A dataset may expose ``targets`` (a sequence of the labels, as torchvision datasets do): the
    per-sample loader then knows the labels without reading every sample once. Items must be
    deterministic (no random transforms inside the dataset): the trainer draws crops and flips per
    global step itself (``data.augment``), which is what keeps exact resume exact.

The first sample of each split is checked eagerly, so a wrong shape or type is exit 2 at start-up,
not a crash at step 1. This module imports torch only inside functions that need it, so config
validation (no torch) can share its syntax check.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch import rundir, suggest
from torchlaunch.base import bounded
from torchlaunch.base.rules import PLUGIN_PATTERN, is_plugin
from torchlaunch.config import ConfigError
from torchlaunch.exit_codes import BadInput

__all__ = [
    "PluginData",
    "is_plugin",
    "resolve",
    "build_model",
    "load_data",
    "origin",
    "origins",
    "check_early",
    "allow_recorded",
    "check_config",
]

MODEL_CALL = "factory(num_classes=N[, width=W])"
DATA_CALL = "factory([root=..., image_size=...]) -> (train, val, classes)"


@dataclass
class PluginData:
    """What a `data.name` factory returns: two map-style datasets and the class names."""

    train: Any
    val: Any
    classes: Sequence[str]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _split(key: str, path: str) -> tuple[str, str]:
    if not re.fullmatch(PLUGIN_PATTERN, path):
        raise ConfigError(
            key, f"{path!r} is not an import path", "write pkg.module:factory, e.g. examples.my_models:tiny_cnn"
        )
    module, attr = path.split(":", 1)
    return module, attr


def _ensure_cwd_on_path() -> None:
    """The run's working directory comes first, as for `python -m` and `python script.py`: under
    submitit or an installed entry point sys.path[0] is something else."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _import(key: str, path: str, module: str) -> Any:
    _ensure_cwd_on_path()
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (module == missing or module.startswith(missing + ".")):
            top = module.split(".")[0]
            raise ConfigError(
                key,
                f"cannot import module {module!r} of {path!r} (No module named {missing!r})",
                f"run from the folder that holds {top}, or add that folder to PYTHONPATH",
            ) from None
        raise ConfigError(
            key,
            f"module {module!r} of {path!r} failed to import: {_first_line(e)}",
            f"install {missing or 'the missing package'} where the workers run",
        ) from None
    except BadInput:
        raise
    except BaseException as e:  # noqa: BLE001 - any error while importing user code is the user's to fix
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(
            key, f"importing module {module!r} of {path!r} raised {_first_line(e)}", f"fix {module} so that it imports"
        ) from None


def resolve(key: str, path: str) -> Callable[..., Any]:
    """`pkg.module:attr` -> the callable it names (attr may be dotted, e.g. Class.build); ConfigError
    naming `key`, the path and the fix for a bad path, a failing import or a missing attribute."""
    module_name, attr = _split(key, path)
    obj: Any = _import(key, path, module_name)
    where = getattr(obj, "__file__", None) or module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            near = suggest.closest(part, names)
            hint = f"did you mean {module_name}:{near}? " if near else ""
            raise ConfigError(
                key,
                f"module {module_name!r} ({where}) has no attribute {part!r} (from {path!r})",
                f"{hint}define {part} there or fix the name after ':'",
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            key,
            f"{path!r} is an object of type {type(obj).__name__}, not a callable factory",
            "point it at a function or class that builds the object",
        )
    return obj


def origin(key: str, path: str) -> dict[str, str | None]:
    """Where a plug-in was found: stored in checkpoints so train.evaluate can find it again from
    another working directory (the module's folder root is put back on sys.path)."""
    module_name, _ = _split(key, path)
    module = sys.modules.get(module_name) or _import(key, path, module_name)
    file = getattr(module, "__file__", None)
    root = None
    if file:
        root = str(
            Path(file).resolve().parents[len(module_name.split(".")) - (0 if file.endswith("__init__.py") else 1)]
        )
    return {"name": path, "file": str(Path(file).resolve()) if file else None, "root": root}


def origins(model_name: str, data_name: str) -> dict[str, dict[str, str | None]]:
    """The plug-ins of a config (only those given as import paths), for the checkpoint."""
    found = {}
    if is_plugin(model_name):
        found["model"] = origin("model.name", model_name)
    if is_plugin(data_name):
        found["data"] = origin("data.name", data_name)
    return found


TRUST_FLAG = "--trust-plugin"
"""train.evaluate's consent to import a plug-in from the folder its checkpoint records."""


def importable(module: str, cwd: str | None = None) -> bool:
    """Whether `module` is found from the working directory, PYTHONPATH or the installed packages as
    they are, looked up on disk without importing anything (torchlaunch.runner.module_origin)."""
    from torchlaunch.runner import module_origin

    cwd = cwd or os.getcwd()
    paths = [cwd, *os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path[1:]]
    return module_origin(module, [p for p in paths if p]) is not None


def allow_recorded(names: dict[str, str], recorded: dict[str, Any] | None, trust: bool) -> None:
    """Loading a checkpoint never runs code the user did not name. A plug-in the checkpoint's config
    names (`names`: key -> pkg.module:factory) is imported only when the user's own environment finds
    it (working directory, PYTHONPATH, installed), or with `trust` from the folder the checkpoint
    records (`recorded`, appended to sys.path after the user's own entries); else BadInput naming the
    module and that folder, before anything is imported."""
    recorded = recorded or {}
    for key, path in names.items():
        if not is_plugin(path):
            continue
        module, _ = _split(key, path)
        if importable(module):
            continue
        entry = recorded.get(key.split(".")[0])
        root = entry.get("root") if isinstance(entry, dict) and isinstance(entry.get("root"), str) else None
        if not trust:
            where = f"the checkpoint records the folder {root}" if root else "the checkpoint records no folder"
            raise BadInput(
                f"evaluate error: the checkpoint's {key}={path} is not importable from {os.getcwd()} or "
                f"PYTHONPATH; {where} (run from the folder that holds {module.split('.')[0]} or add it to "
                f"PYTHONPATH, or pass {TRUST_FLAG} to import {module} from the recorded folder)"
            )
        if root and root not in sys.path and Path(root).is_dir():
            sys.path.append(root)


def check_config(model_name: str, data_name: str) -> list[str]:
    """Import every plug-in a config names (no factory is called): the worker's first check, before
    any data is loaded. Returns "key=path -> file" lines for logs and the doctor."""
    lines = []
    for key, value in (("model.name", model_name), ("data.name", data_name)):
        if is_plugin(value):
            resolve(key, value)
            lines.append(f"{key}={value} -> {origin(key, value)['file']}")
    return lines


# ----------------------------------------------------------------------------------------------
# Models


def build_model(path: str, num_classes: int, width: int = 0) -> Any:
    """Call a model factory with the documented keywords and check it returned an nn.Module."""
    from torch import nn

    factory = resolve("model.name", path)
    kwargs: dict[str, int] = {"num_classes": num_classes}
    if width:
        kwargs["width"] = width
    try:
        model = factory(**kwargs)
    except (BadInput, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - a factory's failure (SystemExit too) is reported as bad input
        raise ConfigError(
            "model.name",
            f"factory {path!r} raised {_first_line(e)} when called as "
            f"{path.split(':')[1]}({', '.join(f'{k}={v}' for k, v in kwargs.items())})",
            f"fix the factory; it is called as {MODEL_CALL}",
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model.name",
            f"factory {path!r} returned {type(model).__name__}, not a torch.nn.Module",
            "return the model instance, e.g. `return MyNet(num_classes)`",
        )
    return model


# ----------------------------------------------------------------------------------------------
# Data


def _accepted_kwargs(factory: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(offered)
    names = {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in offered.items() if k in names}


FACTORY_TIMEOUT_S = 600.0
"""The longest a data factory may take (base.bounded). It runs before the first step, where the hang
watchdog is not armed yet: a factory that never returns would hold every rank, and the ranks waiting on
this one, for ever. Ten minutes is room for indexing a large folder, not for a hang."""

MAX_SAMPLES = 10**9
"""A split's largest `__len__`: the loaders keep a label and an index per sample, and a per-sample split
without `targets` reads every label once at start (a billion is hours of it already)."""

MAX_CLASSES = 1 << 17
"""The most class names: 131,072 is 6x ImageNet-21k's; the classifier head, its optimiser state and
the per-class metrics grow with it (a million classes died after 112 s with a traceback, issue 52)."""


def _call_factory(factory: Callable[..., Any], path: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
    """factory(**kwargs) within `timeout_s`; its failure or hang is ConfigError (exit 2, one line)."""
    try:
        return bounded.call(lambda: factory(**kwargs), timeout_s, f"data factory {path}")
    except bounded.Failed as e:
        if isinstance(e.error, BadInput):
            raise e.error from None
        fix = f"fix the factory; it is called as {DATA_CALL}"
        if e.timed_out:
            fix = "make it return sooner: read lazily, in the dataset's __getitem__"
        raise ConfigError("data.name", f"factory {path!r} {e}", fix) from None


def _split_size(path: str, split: str, ds: Any) -> int:
    """len(ds), checked before anything is allocated for it: an int in [1, MAX_SAMPLES]."""
    try:
        n = len(ds)
    except Exception as e:  # noqa: BLE001 - the dataset's own __len__: negative, not an int, too big for one
        raise ConfigError(
            "data.name", f"factory {path!r}: len() of the {split} split raised {_first_line(e)}", "fix __len__"
        ) from None
    if n == 0:
        raise ConfigError(
            "data.name", f"factory {path!r}: the {split} split is empty", "return at least one sample in each split"
        )
    if n > MAX_SAMPLES:
        raise ConfigError(
            "data.name",
            f"factory {path!r}: the {split} split says it has {n} samples, more than {MAX_SAMPLES}",
            "fix __len__, or store a set that large as shards (torchlaunch.data.shards)",
        )
    return n


def load_data(path: str, root: str, image_size: int, timeout_s: float = FACTORY_TIMEOUT_S) -> PluginData:
    """Call a data factory (within `timeout_s`) and check its result before anything is allocated for it:
    two non-empty map-style datasets of at most MAX_SAMPLES, 2 to MAX_CLASSES class names, and a
    well-formed first sample in each split."""
    factory = resolve("data.name", path)
    kwargs = _accepted_kwargs(factory, {"root": root, "image_size": image_size})
    result = _call_factory(factory, path, kwargs, timeout_s)
    if isinstance(result, (tuple, list)) and len(result) == 3:
        result = PluginData(*result)
    if not isinstance(result, PluginData):
        raise ConfigError(
            "data.name",
            f"factory {path!r} returned {type(result).__name__}",
            "return (train, val, classes) or torchlaunch.worker.plugins.PluginData; see examples/my_data.py",
        )
    classes = result.classes
    if isinstance(classes, Sequence) and not isinstance(classes, (str, bytes)) and len(classes) > MAX_CLASSES:
        raise ConfigError(
            "data.name",
            f"factory {path!r}: {len(classes)} classes, more than {MAX_CLASSES}",
            "return the class names of the labels the dataset gives",
        )
    if (
        isinstance(classes, (str, bytes))
        or not isinstance(classes, Sequence)
        or len(classes) < 2
        or not all(isinstance(c, str) for c in classes)
    ):
        raise ConfigError(
            "data.name",
            f"factory {path!r}: classes must be a list of at least 2 strings, got {str(classes)[:60]}",
            "return the class names as the third item",
        )
    result.classes = list(classes)
    for split in ("train", "val"):
        ds = getattr(result, split)
        from torchlaunch.data.shards.reader import is_shard_set

        if is_shard_set(ds):  # a torchlaunch.data.shards.ShardSet as the storage: its index was checked on open
            if len(ds) == 0:
                raise ConfigError(
                    "data.name", f"factory {path!r}: the {split} shard set is empty", "return non-empty shard sets"
                )
            continue
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise ConfigError(
                "data.name",
                f"factory {path!r}: the {split} split is a {type(ds).__name__}, not a map-style dataset",
                "return objects with __len__ and __getitem__ (e.g. a torch.utils.data.Dataset) or a torchlaunch.data.shards.ShardSet",
            )
        _split_size(path, split, ds)
        check_sample(path, split, 0, _get(path, split, ds, 0), len(result.classes))
    return result


def _get(path: str, split: str, ds: Any, index: int) -> Any:
    try:
        return ds[index]
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            "data.name",
            f"{path!r}: reading {split} sample {index} raised {_first_line(e)}",
            "fix the dataset's __getitem__",
        ) from None


def describe(value: Any) -> str:
    """A short description of a sample's part for error lines."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {value.dtype}"
    size = getattr(value, "size", None)
    if isinstance(size, tuple) and hasattr(value, "mode"):
        return f"PIL image {size[0]}x{size[1]} mode {value.mode}"
    return f"{type(value).__name__} {str(value)[:40]!r}"


def check_sample(path: str, split: str, index: int, sample: Any, num_classes: int) -> None:
    """An item must be (CHW 3-channel tensor or PIL image, int label in range)."""
    import torch
    from PIL import Image

    fix = (
        "return (image, label): image a 3xHxW tensor (uint8, or float in [0, 1]) or a PIL image, "
        "label an int; see examples/my_data.py"
    )
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ConfigError(
            "data.name", f"{path!r}: {split} sample {index} is {describe(sample)}, not an (image, label) pair", fix
        )
    image, label = sample
    if isinstance(image, torch.Tensor):
        ok = (
            image.dim() == 3
            and image.shape[0] == 3
            and image.shape[1] > 0
            and image.shape[2] > 0
            and (image.dtype == torch.uint8 or image.is_floating_point())
        )
    else:
        ok = isinstance(image, Image.Image)
    if not ok:
        raise ConfigError("data.name", f"{path!r}: {split} sample {index} image is {describe(image)}", fix)
    if isinstance(label, torch.Tensor) and label.dim() == 0 and not label.is_floating_point():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_classes:
        raise ConfigError(
            "data.name",
            f"{path!r}: {split} sample {index} label is {describe(label)}, not an int in [0, {num_classes})",
            fix,
        )


def to_uint8(path: str, split: str, index: int, image: Any, size: int) -> Any:
    """One plug-in image -> uint8 (3, size, size), the form both loaders batch and augment."""
    import numpy as np
    import torch
    from PIL import Image

    if isinstance(image, Image.Image):
        im = image.convert("RGB")
        if im.size != (size, size):
            im = im.resize((size, size), Image.Resampling.BILINEAR)
        return torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)
    if not isinstance(image, torch.Tensor) or image.dim() != 3 or image.shape[0] != 3:
        raise ConfigError(
            "data.name",
            f"{path!r}: {split} sample {index} image is {describe(image)}",
            "return a 3xHxW tensor or a PIL image for every sample",
        )
    x = image.detach().cpu()
    if x.is_floating_point():
        x = (x.float() * 255.0).round().clamp(0, 255)
    if tuple(x.shape[1:]) != (size, size):
        x = (
            torch.nn.functional.interpolate(
                x.float()[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True
            )[0]
            .round()
            .clamp(0, 255)
        )
    return x.to(torch.uint8).contiguous()


def to_label(path: str, split: str, index: int, label: Any, num_classes: int) -> int:
    if hasattr(label, "item") and not isinstance(label, int):
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_classes:
        raise ConfigError(
            "data.name",
            f"{path!r}: {split} sample {index} label is {describe(label)}, not an int in [0, {num_classes})",
            "return an int label for every sample",
        )
    return label


def check_early(cfg: Any) -> None:
    """The worker's first check, on every rank before any data is loaded or model built: every plug-in
    imports and names a callable, and a fresh run's model.init_from exists."""
    check_config(cfg.model.name, cfg.data.name)
    if cfg.model.init_from:
        from torchlaunch.worker import init_from

        if not init_from.will_resume(cfg.checkpoint.resume, rundir.checkpoints(Path(cfg.run_dir).expanduser())):
            init_from.locate(cfg.model.init_from)
