"""test_ops_state_of_processes: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_ops_state.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import launcher_argv
from tests.unit.test_ops_state import (
    HOST,
    live_process,  # noqa: F401 (fixtures, used by name)
    status_of,
    write,
)
from torchlaunch.base import procs
from torchlaunch.jobs import progress, record
from torchlaunch.jobs.record import JobRecord


def test_status_of_a_running_run_dir(tmp_path: Path, live_process: subprocess.Popen) -> None:
    rid = {"launch_id": "abc", "scheduler": "local", "host": HOST, "started": time.time() - 60}
    pid = {"launcher_pid": live_process.pid, "launcher_start": procs.start_ticks(live_process.pid)}
    write(record.record_path(tmp_path), {**rid, **pid, "command": ["python", "-m", "launch.local"]})
    hb = {"rank": 0, "launch": "abc", "host": HOST, "step": 5, "total": 50, "epoch": 0, "time": time.time()}
    write(progress.beat_path(progress.folder(tmp_path), 0), {**hb, "step_time": 1.0, "images_per_s": 100.0})
    code, text = status_of(tmp_path)
    assert code == 0
    assert "state:      running" in text and "step:       5/50" in text and "ETA 45s" in text
    code, text = status_of(tmp_path, "--json")
    data = json.loads(text)
    assert (data["state"], data["step"], data["total"], data["launch_id"]) == ("running", 5, 50, "abc")
    assert data["ranks"][0]["rank"] == 0 and data["checkpoint"] is None


def test_a_launcher_that_died_is_failed(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = procs.start_ticks(child.pid)
    child.wait(timeout=30)
    write(
        record.record_path(tmp_path),
        {"launch_id": "x1", "host": HOST, "launcher_pid": child.pid, "launcher_start": ticks},
    )
    code, text = status_of(tmp_path, "--json")
    assert json.loads(text)["state"] == "failed"


def test_python_m_launch_is_torch_free(tmp_path: Path) -> None:
    code = f"import sys; sys.argv=['launch', 'status', {str(tmp_path)!r}]; "
    code += "import torchlaunch.jobs.cli as c; c.main(sys.argv[1:]); assert 'torch' not in sys.modules, 'torch loaded'"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        launcher_argv("launch", "status", str(tmp_path), "--json"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["state"] == "unknown"


def test_a_scheduler_job_is_not_judged_by_the_submitting_pid(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = procs.start_ticks(child.pid)
    child.wait(timeout=30)
    common = {"host": HOST, "launcher_pid": child.pid, "launcher_start": ticks}
    assert JobRecord(launch_id="s", scheduler="slurm", **common).launcher_alive() is None  # type: ignore[arg-type]
    assert JobRecord(launch_id="l", scheduler="local", **common).launcher_alive() is False  # type: ignore[arg-type]
