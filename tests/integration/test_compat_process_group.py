"""test_compat_process_group: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_compat.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from torchlaunch import compat


def test_the_default_store_of_a_one_rank_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        store = compat.default_store()
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        dist.destroy_process_group()


def test_set_group_timeout_changes_the_default_groups_timeout() -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=300)
    )
    try:
        compat.set_group_timeout(12.5)
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == datetime.timedelta(seconds=12.5)
    finally:
        dist.destroy_process_group()
