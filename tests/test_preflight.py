"""train.preflight: pure checks, and real 2-rank gloo runs (torchrun, and two 'nodes' whose
run_dir is private to each, which is what a node-local "shared" folder looks like)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import launcher_argv
from torchlaunch.tools import preflight
from torchlaunch.tools.doctor import FAIL, OK, WARN

REPO = Path(__file__).resolve().parents[1]


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchrun_two_ranks_on_shared_dir_pass(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "run")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "torchlaunch.tools.preflight",
        "--config",
        str(config),
        *PREFLIGHT_ARGS,
    ]
    result = subprocess.run(cmd, env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("preflight summary") == 1  # one table, from rank 0 only
    assert "2 ranks correct" in result.stdout
    assert "seen by all 2 rank(s)" in result.stdout
    assert "0->" in result.stdout and "1->" in result.stdout
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".preflight")]


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_private_run_dirs_are_detected_as_not_shared(tmp_path: Path) -> None:
    """Two one-process 'nodes', each with its own folder: the node-local storage mistake."""
    config = write_config(tmp_path, tmp_path / "unused")
    port = free_port()
    dirs = [tmp_path / "node0-local", tmp_path / "node1-local"]
    procs = [start_rank(rank, port, config, dirs[rank]) for rank in (0, 1)]
    outputs = [p.communicate(timeout=100) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [2, 2], outputs
    table = outputs[0][0]
    assert "[FAIL] shared storage" in table
    assert f"rank 1 on {socket.gethostname()} cannot read the token" in table
    assert str(dirs[0]) in table and str(dirs[1]) in table
    assert "preflight: FAILED" in table
    assert outputs[1][0] == ""  # rank 1 prints no table


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


@pytest.mark.timeout(60)
def test_single_process_reports_short_lead_time(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "run", lead_time_s=1e-6)
    result = run_preflight_alone("--config", str(config), *PREFLIGHT_ARGS)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[FAIL] signal lead time" in result.stdout
    assert "1 rank: correct" in result.stdout


def test_missing_config_is_bad_input(tmp_path: Path) -> None:
    result = run_preflight_alone("--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "nope.yaml" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def run_local_launcher(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """launch.local with the pre-flight module: what `launch.local --doctor` runs."""
    cmd = launcher_argv(
        "torchlaunch.backends.local.launch",
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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_through_launch_local_exit_codes_reach_the_caller(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "run")
    good = run_local_launcher(config)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "seen by all 2 rank(s)" in good.stdout
    bad = run_local_launcher(config, "preemption.lead_time_s=0.000001")
    assert bad.returncode == 2, bad.stdout + bad.stderr  # torchrun alone would say 1
    assert "[FAIL] signal lead time" in bad.stdout
    assert "preflight: signal lead time" in bad.stderr
