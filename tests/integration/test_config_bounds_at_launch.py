"""test_config_bounds_at_launch: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_config_bounds.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.unit.test_config_bounds import _local
from torchlaunch.exit_codes import BAD_INPUT


def test_a_config_file_too_deep_exits_2_in_one_line_through_the_worker(tmp_path: Path) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text("train:\n  epochs: " + "[" * 100_000 + "]" * 100_000 + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(f), f"run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == BAD_INPUT, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nested more than 64" in lines[0], proc.stderr[-2000:]


def test_a_rendezvous_port_in_use_on_node_0_is_refused(tmp_path: Path, capsys) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        rc, err = _local(["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(taken)], tmp_path, capsys)
    assert rc == BAD_INPUT and len(err) == 1 and "already in use" in err[0], err
