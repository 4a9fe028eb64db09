"""Whether a rank of a multi-rank job ever joined a process group: torch-free until torch is imported.

`Accelerator()` on CPU without `cpu=True`, or a script that never calls `init_process_group`, runs every
rank as an independent single-process run writing the same files, and exits 0: nothing says the job was
not distributed. The runner cannot ask at the end (`destroy_process_group` forgets every group), so a
meta-path finder wraps `torch.distributed.distributed_c10d.init_process_group` as that module is first
imported, before `torch.distributed` re-exports it: every caller, whatever it imported, is counted.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

C10D = "torch.distributed.distributed_c10d"
_joined = {"count": 0}


def joined() -> bool:
    return _joined["count"] > 0


def _count(function: Any) -> Any:
    @functools.wraps(function)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        _joined["count"] += 1
        return result

    return init_process_group


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != C10D:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original(module)
            if callable(getattr(module, "init_process_group", None)):
                module.init_process_group = _count(module.init_process_group)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def watch() -> None:
    """Count init_process_group calls from now on (a no-op when torch.distributed is already imported:
    the runner imports no torch, so under a launcher it never is)."""
    if C10D not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
