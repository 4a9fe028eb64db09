"""Every private API of torch, submitit and argparse the project relies on, in one place.

A private name can change in any release; here each one is reached through one function, and
tests/unit/test_compat.py exercises each against the installed version, so an upgrade that breaks one
fails one named test instead of a rank at 3 a.m. Imports are inside the functions: the launchers
import this module without torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SUBMITIT_TASK_MODULE = "submitit.core._submit"
"""What submitit runs in each Slurm task (SlurmExecutor._submitit_command_str), with our python."""


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """option string -> its Action (argparse's `_option_string_actions`): which options take a value."""
    return parser._option_string_actions


def undecorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function under functools.wraps layers (torch's optimizer methods are wrapped in dynamo's
    disable and the profiler hook; calling the inner one skips the torch._dynamo import)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def default_store() -> Any:
    """The process group's default c10d store (torch.distributed.distributed_c10d._get_default_store)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def set_group_timeout(seconds: float) -> None:
    """The default process group's timeout for every later collective (torch.distributed.set_timeout;
    before it was public, distributed_c10d._set_pg_timeout, which torch 2.14 keeps as its alias)."""
    import datetime

    import torch.distributed as dist

    setter = getattr(dist, "set_timeout", None)
    if setter is None:
        from torch.distributed import distributed_c10d

        setter = distributed_c10d._set_pg_timeout
    setter(datetime.timedelta(seconds=seconds))


def agent_stops_once() -> None:
    """torchrun's agent acts on its first stop signal only (torch.distributed.elastic.multiprocessing.api.
    _terminate_process_handler, looked up when the agent starts its workers).

    Its handler raises SignalException on every stop signal; the first one starts the graceful shutdown
    (the signal passed on to each worker's process group, up to the shutdown timeout for their
    checkpoint), and a second one raised inside that wait abandons it: the agent exits and its ranks
    die with it (pdeath) before they commit. A second one is what the world sends: a signal to every
    process of a job reaches the agent directly and again through the launcher, a scheduler repeats it."""
    from torch.distributed.elastic.multiprocessing import api

    original = api._terminate_process_handler
    if getattr(original, "stops_once", False):
        return
    seen: list[int] = []

    def first_only(signum: int, frame: Any) -> None:
        if seen:
            return
        seen.append(signum)
        original(signum, frame)

    first_only.stops_once = True  # type: ignore[attr-defined]
    api._terminate_process_handler = first_only


def fused_kernel_devices() -> list[str] | None:
    """Device types with fused SGD/AdamW kernels (torch.utils._foreach_utils); None where torch has no such list."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return None
    return list(_get_fused_kernels_supported_devices())


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 on this CPU (torch.ops.mkldnn._is_mkldnn_bf16_supported); False if unknown."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def delayed_submission(fn: Callable[[], Any]) -> Any:
    """submitit's picklable (callable, args) record of a submitted task (submitit.core.utils)."""
    from submitit.core import utils

    return utils.DelayedSubmission(fn)


@contextmanager
def temporary_save_path(path: str | Path) -> Iterator[Path]:
    """submitit's temp-then-rename save of a task pickle (submitit.core.utils.temporary_save_path)."""
    from submitit.core import utils

    with utils.temporary_save_path(path) as tmp:
        yield Path(tmp)
