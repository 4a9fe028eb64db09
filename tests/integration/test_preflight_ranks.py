"""test_preflight_ranks: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_preflight.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.unit.test_preflight import (
    PREFLIGHT_ARGS,
    REPO,
    base_env,
    run_local_launcher,
    run_preflight_alone,
    start_rank,
    write_config,
)


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
