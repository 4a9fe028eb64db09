"""CPU affinity for CPU-only workers that share a machine: each local rank gets its own cores.

Why: with several ranks on one CPU machine the scheduler moves compute threads between cores, so
each rank loses its caches and the ranks' step times drift apart; every gradient all-reduce then
waits for the slower one. Pinning local rank i to the i-th slice of the cores this process may use
measured +3.5% images/s for 2 ranks x 1 thread on 2 cores (bench/ddp.py). Only where it is safe:
CPU device, more than one local rank (single-rank "nodes" sharing a host, e.g. network-namespace
nodes or Slurm nodes on one machine, would all pin to the same slice), and at least one core per
rank in the inherited mask (so Slurm/cgroup CPU sets are respected, not widened).
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def core_slice(available: Sequence[int], local_rank: int, local_world_size: int) -> list[int] | None:
    """The cores local rank `local_rank` of `local_world_size` should run on, or None to leave the
    mask alone (one rank, or fewer cores than ranks). Pure: contiguous equal slices of the sorted
    mask; the remainder cores go to the last rank."""
    cores = sorted(available)
    if local_world_size <= 1 or len(cores) < local_world_size or not 0 <= local_rank < local_world_size:
        return None
    width = len(cores) // local_world_size
    start = local_rank * width
    end = len(cores) if local_rank == local_world_size - 1 else start + width
    return cores[start:end]


def pin_local_rank(local_rank: int, local_world_size: int) -> list[int] | None:
    """Restrict this process (and the threads it starts later: OpenMP, gloo) to its core slice.
    Returns the cores, or None when nothing was changed (not supported here, or not applicable)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = core_slice(sorted(os.sched_getaffinity(0)), local_rank, local_world_size)
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    return cores
