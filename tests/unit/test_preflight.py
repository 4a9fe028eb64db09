"""train.preflight: pure checks, and real 2-rank gloo runs (torchrun, and two 'nodes' whose
run_dir is private to each, which is what a node-local "shared" folder looks like)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.conftest import REPO, launcher_argv
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.tools import preflight
from torchlaunch.tools.machine_checks import FAIL, OK, WARN
from torchlaunch.worker.lead_time import lead_time_warning


def info(rank: int, **changes: object) -> preflight.RankInfo:
    base = preflight.RankInfo(
        rank=rank,
        local_rank=rank,
        host="node0",
        device=f"cuda:{rank}",
        device_uuid=f"GPU-{rank}",
        run_dir="/shared/run",
        token_seen=True,
        token_detail="token matches",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- pure checks


def test_expected_checkpoint_bytes_counts_optimizer_state() -> None:
    assert preflight.expected_checkpoint_bytes(1_000_000) == 12_000_000


def test_free_space_fails_below_retention_times_size() -> None:
    finding = preflight.check_free_space(3 * 2**30, 2**30, keep=2, run_dir="/runs/a")
    assert finding.level == FAIL
    assert "/runs/a" in finding.message and "4.0 GiB" in finding.message
    assert "checkpoint.keep" in finding.fix
    assert preflight.check_free_space(4 * 2**30, 2**30, keep=2, run_dir="/r").level == OK
    unknown = preflight.check_free_space(2**40, 2**30, 2, "/r", params_known=False)
    assert unknown.level == WARN


def test_lead_time_against_save_time() -> None:
    short = preflight.check_lead_time(10, save_s=5.0, checkpoint_bytes=2**30)
    assert short.level == FAIL and "at least 15s" in short.fix and "--signal=USR2@" in short.fix
    assert preflight.check_lead_time(90, 5.0, 2**30).level == OK
    unknown = preflight.check_lead_time(0, 5.0, 2**30)
    assert unknown.level == WARN and "preemption.lead_time_s" in unknown.fix


def test_a_save_that_cannot_fit_the_grace_is_one_line_with_its_figure_and_the_bound(tmp_path: Path) -> None:
    """Issue #53: when even the save cannot fit in the time a stop leaves, the start says so in one line,
    with the save time it measured and the periodic checkpoint interval that bounds the loss; a save that
    fits says nothing. The probe checkpoint is removed either way."""
    state = {"format_version": ckpt.FORMAT_VERSION, "model": {"w": torch.zeros(1000)}}
    probe = tmp_path / ".save-probe"
    line = lead_time_warning(1e-6, probe, state, "the platform's grace", every_steps=200)
    assert line is not None and "\n" not in line
    assert "the platform's grace (1e-06 s for the ranks) is below 3x the measured save time (" in line
    assert re.search(r"measured save time \(\d+\.\d\d s\)", line), line
    assert "a stop then loses up to checkpoint.every_steps=200 steps" in line
    unbounded = lead_time_warning(1e-6, probe, state, every_steps=0)
    assert unbounded is not None and "preemption.lead_time_s=1e-06" in unbounded
    assert "since the last epoch-end checkpoint (checkpoint.every_steps=0)" in unbounded
    assert lead_time_warning(3600.0, probe, state, "the platform's grace", every_steps=200) is None
    assert not probe.exists()


def test_two_ranks_on_one_gpu_fail() -> None:
    infos = [info(0), info(1, device_uuid="GPU-0", local_rank=1)]
    [finding] = preflight.check_device_map(infos)
    assert finding.level == FAIL and "ranks 0, 1 share GPU GPU-0 on node0" in finding.message


def test_duplicate_local_rank_on_one_host_fails() -> None:
    infos = [info(0, device_uuid=None), info(1, local_rank=0, device_uuid=None)]
    [finding] = preflight.check_device_map(infos)
    assert finding.level == FAIL and "LOCAL_RANK=0 on host node0" in finding.message


def test_distinct_devices_pass_and_list_the_map() -> None:
    infos = [info(0), info(1), info(2, host="node1", local_rank=0, device="cuda:0")]
    [finding] = preflight.check_device_map(infos)
    assert finding.level == OK and "2->node1:cuda:0" in finding.message


def test_unshared_storage_names_the_folder_and_host() -> None:
    infos = [
        info(0),
        info(
            1,
            host="node1",
            run_dir="/local/run",
            token_seen=False,
            token_detail="file not found after 10s",
        ),
    ]
    [finding] = preflight.check_shared_storage(infos, "/shared/run/.preflight-token-ab")
    assert finding.level == FAIL
    assert "rank 1 on node1" in finding.message
    assert "/shared/run/.preflight-token-ab" in finding.message
    assert "/local/run" in finding.message and "file not found" in finding.message
    assert "NFS" in finding.fix


def test_all_reduce_wrong_sum_fails() -> None:
    results = [
        {"bytes": 2**20, "seconds": 0.01, "correct": True, "bus_bytes_per_s": 1e8},
        {"bytes": 2**23, "seconds": 0.05, "correct": False, "bus_bytes_per_s": 1e8},
    ]
    [finding] = preflight.check_all_reduce(results, 2)
    assert finding.level == FAIL and "8.0 MiB" in finding.message
    ok = preflight.check_all_reduce(results[:1], 2)
    assert ok[0].level == OK and "GB/s" in ok[0].message


def test_default_sizes_are_bounded() -> None:
    assert max(preflight.default_sizes("cpu", 256)) == 2**23
    assert max(preflight.default_sizes("cuda", 64)) == 2**26
    assert preflight.default_sizes("cpu", 0.001) == [2**16]


def test_read_token_is_bounded_and_finds_late_files(tmp_path: Path) -> None:
    path = tmp_path / "token"
    start = time.monotonic()
    seen, detail = preflight.read_token(path, "abc", deadline_s=0.3)
    assert not seen and "file not found" in detail
    assert time.monotonic() - start < 2
    path.write_text("xyz")
    assert preflight.read_token(path, "abc", 0)[1].startswith("a different token")
    path.write_text("abc")
    assert preflight.read_token(path, "abc", 0) == (True, "token matches")


# --------------------------------------------------------------------------- real processes


def write_config(tmp_path: Path, run_dir: Path, lead_time_s: float = 120) -> Path:
    config = tmp_path / "preflight.yaml"
    config.write_text(f"run_dir: {run_dir}\ncheckpoint:\n  keep: 2\npreemption:\n  lead_time_s: {lead_time_s}\n")
    return config


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    return env


PREFLIGHT_ARGS = ["--max-mib", "1", "--token-wait-s", "1"]


def start_rank(rank: int, port: int, config: Path, run_dir: Path) -> subprocess.Popen:
    env = base_env()
    env.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    cmd = [
        sys.executable,
        "-m",
        "torchlaunch.tools.preflight",
        "--config",
        str(config),
        f"run_dir={run_dir}",
        *PREFLIGHT_ARGS,
    ]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_preflight_alone(*args: str) -> subprocess.CompletedProcess:
    """`python -m train.preflight ARGS` as one process (no launcher), bounded in time."""
    return subprocess.run(
        [sys.executable, "-m", "torchlaunch.tools.preflight", *args],
        env=base_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )


def run_local_launcher(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """launch.local with the pre-flight module: what `launch.local --doctor` runs."""
    cmd = launcher_argv(
        "torchlaunch.agent",
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--config",
        str(config),
        "--doctor",
        *overrides,
    )
    return subprocess.run(cmd, env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
