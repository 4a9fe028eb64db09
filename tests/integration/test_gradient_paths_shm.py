"""How DDP gradients travel on CPU (train/shm_reduce.py, train/affinity.py): shared memory on one
machine gives the same numbers bit for bit as gloo, falls back to gloo together when /dev/shm cannot
be used, leaves nothing behind; CPU workers sharing a machine pin to disjoint core slices."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.helpers import REPO, assert_models_equal, launcher, leave_spawned_rank
from torchlaunch.core import fixed_point
from torchlaunch.core.affinity import core_slice
from torchlaunch.core.dist import rank_order_mean
from torchlaunch.core.shm_reduce import build_reducer, build_shared_sum

# ------------------------------------------------------------------ affinity (pure)


def test_pinning_restricts_the_process_to_its_slice() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores to pin two ranks apart")
    code = (
        "import os, json; from torchlaunch.core.affinity import pin_local_rank; "
        "r = pin_local_rank(1, 2); print(json.dumps([r, sorted(os.sched_getaffinity(0))]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    returned, actual = json.loads(out.stdout)
    assert returned == actual == core_slice(cores, 1, 2)
    assert cores[0] not in actual


# ------------------------------------------------------------------ shared-memory reducer


def _probe_rank(rank: int, world: int, store_file: str, shm_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        model = nn.Linear(8, 4)
        reducer = build_reducer(model, shm_dir=shm_dir)
        result: dict[str, object] = {"reducer": reducer is not None}
        if reducer is not None:
            grads = torch.randn(36)
            everyone = [torch.empty_like(grads) for _ in range(world)]
            dist.all_gather(everyone, grads)
            expected = everyone[0].clone()
            for part in everyone[1:]:
                expected += part
            expected /= world
            for _ in range(3):  # both parities, then the first one again
                averaged = reducer.average(grads.clone())
                result.setdefault("equal", []).append(bool(torch.equal(averaged, expected)))
            flat = torch.randn(100)  # live mode's flat buffer: larger than a slot (36 floats), in pieces
            everyone = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(everyone, flat)
            reducer.average_flat(flat)
            result["flat_equal"] = bool(torch.equal(flat, rank_order_mean(everyone, out=torch.empty(100))))
        result["exact"] = _exact_sums(model, rank, world, shm_dir)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_spawned_rank()


def _exact_sums(model: nn.Module, rank: int, world: int, shm_dir: str) -> list[bool] | None:
    """train.exact's sum through shared memory (build_shared_sum) against gloo's all-reduce and against
    one rank holding every part: rank r holds r parts (rank 0 none), magnitudes 1e0 .. 1e-3."""
    shared = build_shared_sum(model, shm_dir=shm_dir)
    if shared is None:
        return None
    like = [p.detach() for p in model.parameters()]

    def parts_of(r: int) -> list[list[torch.Tensor]]:
        g = torch.Generator().manual_seed(r)
        return [[torch.randn(t.shape, generator=g) * 10.0 ** -(r + j) for t in like] for j in range(r)]

    everyone = [part for r in range(world) for part in parts_of(r)]
    alone = fixed_point.exact_mean(
        everyone,
        like,
        fixed_point.local_max(everyone, 2, torch.device("cpu")),
        len(everyone),
        fixed_point.LocalSum(False),
    )
    mine = parts_of(rank)
    maxima = fixed_point.agree_max(fixed_point.local_max(mine, 2, torch.device("cpu")), True)
    gloo = fixed_point.LocalSum(True)
    equal = []
    for _ in range(3):  # both parities, then the first one again
        via_shm = fixed_point.exact_mean(mine, like, maxima, len(everyone), shared)
        via_gloo = fixed_point.exact_mean(mine, like, maxima, len(everyone), gloo)
        equal.append(
            all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(via_shm, via_gloo, alone, strict=True))
        )
    return equal


def _probe(tmp_path: Path, world: int, shm_dir: str) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(
        _probe_rank,
        args=(world, str(tmp_path / "store"), shm_dir, str(out)),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def test_shared_memory_average_is_the_rank_order_mean_and_leaves_no_file(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    results = _probe(tmp_path, 3, str(shm))
    assert all(r["reducer"] for r in results)
    assert all(r["equal"] == [True, True, True] and r["flat_equal"] for r in results), results
    assert all(r["exact"] == [True, True, True] for r in results), results  # train.exact's sums, same bits
    assert list(shm.iterdir()) == []  # unlinked as soon as every rank had mapped it


def test_every_rank_falls_back_to_gloo_together_when_shm_is_unusable(tmp_path: Path) -> None:
    results = _probe(tmp_path, 2, str(tmp_path / "no-such-dir"))
    assert [(r["reducer"], r["exact"]) for r in results] == [(False, None), (False, None)]


# ------------------------------------------------------------------ real runs: same bits either way

SMALL = [
    "data.synthetic_train_size=576",
    "data.synthetic_val_size=128",
    "train.batch_size=48",
    "train.epochs=1",
    "checkpoint.every_steps=0",
]


LIVE = "live: {}, group re-formed on a lost rank"


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, road, shm_path, gloo_path",
    [
        (2, "recovery.live=false", "shared memory", "gloo"),
        (
            2,
            "recovery.live=auto",
            LIVE.format("shared memory"),
            LIVE.format("gloo all-reduces overlapped with backward"),
        ),
        pytest.param(3, "recovery.live=false", "shared memory", "gloo, rank order", marks=pytest.mark.extended),
    ],
)
def test_shared_memory_and_gloo_train_identical_models(
    tmp_path: Path, ranks: int, road: str, shm_path: str, gloo_path: str
) -> None:
    """On either road: DDP's buckets (the restart road) and the live group's, posted from backward's
    hooks across machines (live/grads.OverlappedGradients), give shared memory's bits."""
    runs = {}
    for shm in ("true", "false"):
        run_dir = tmp_path / f"shm-{shm}"
        done = launcher(
            [
                "--gpus",
                str(ranks),
                "--config",
                "configs/smoke.yaml",
                f"run_dir={run_dir}",
                *SMALL,
                road,
                f"dist.shared_memory_reduce={shm}",
            ]
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs[shm] = (run_dir, done.stdout + done.stderr)
    assert re.findall(r"gradients: ([^\n]+)", runs["true"][1]) == [shm_path]
    assert re.findall(r"gradients: ([^\n]+)", runs["false"][1]) == [gloo_path]
    assert_models_equal(runs["true"][0] / "model.pt", runs["false"][0] / "model.pt")
