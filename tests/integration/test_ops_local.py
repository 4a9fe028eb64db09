"""Operating a launch.local job end to end (real torchrun, 2 CPU ranks, the built-in worker): `status`
while it runs, `logs` of both ranks, `list`, `cancel` -> a committed checkpoint, state `cancelled`, and the
same command resumes bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import launcher_argv, run_proc
from tests.helpers import REPO, assert_models_equal
from tests.integration.test_resume import SMALL
from tests.library import RunLibrary
from torchlaunch.exit_codes import CANCELLED, FAILURE, OK

pytestmark = pytest.mark.slow

RECIPE = [
    "--device",
    "cpu",
    "--gpus",
    "2",
    "--config",
    "configs/smoke.yaml",
    "train.epochs=8",
    "checkpoint.every_steps=4",
]


def ops(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_proc(launcher_argv("launch", *argv), timeout=120)


def committed(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any(p.is_dir() and any(p.iterdir()) for p in root.iterdir())


@pytest.mark.timeout(900)
def test_status_logs_list_cancel_then_the_same_command_resumes_bit_for_bit(
    run_library: RunLibrary, tmp_path: Path
) -> None:
    # The recipe of the session's "resume" library run (test_resume.run): its weights are the reference.
    reference, run_dir = run_library.path("resume"), tmp_path / "run"
    recipe = ["--gpus", "2", "--max-restarts", "0", "--config", "configs/smoke.yaml", f"run_dir={run_dir}", *SMALL]
    # test_resume.run's road too, and the hold below (SIGSTOP of both ranks) is no pause on the live road:
    # its agent fences a rank silent past recovery.heartbeat_timeout_s (SIGKILL), and the run ends
    recipe.append("recovery.live=false")
    argv = launcher_argv("torchlaunch.agent", *recipe)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (committed(run_dir) and beat(run_dir, 0).get("pid") and beat(run_dir, 1).get("pid")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        # Hold both ranks still while the commands are asked, so the run cannot finish before the cancel
        # (on a loaded host it did: the SIGTERM came 24 ms before the last step); let them go after it.
        ranks = [beat(run_dir, r)["pid"] for r in (0, 1)]
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        st = ops("status", str(run_dir))
        assert st.returncode == 0 and "state:      running" in st.stdout, st.stdout + st.stderr
        logs = ops("logs", str(run_dir))
        assert "[rank 0] starting simple_cnn" in logs.stdout, logs.stdout[-2000:] + logs.stderr
        assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == ["rank-0.log", "rank-1.log"]
        assert "[rank 0]" not in ops("logs", str(run_dir), "--rank", "1").stdout  # the rank filter
        listed = ops("list", str(tmp_path))
        assert "run" in listed.stdout and "running" in listed.stdout, listed.stdout + listed.stderr
        cancel = ops("cancel", str(run_dir))
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        assert cancel.returncode == 0 and "SIGTERM" in cancel.stdout, cancel.stdout + cancel.stderr
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == CANCELLED, err[-3000:]  # never requeued: not 75
    assert "launch: cancelled (exit 3, never requeued) (newest checkpoint: step" in err
    st = ops("status", str(run_dir))
    assert "state:      cancelled" in st.stdout, st.stdout + st.stderr
    assert not (run_dir / "model.pt").exists()
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert again.returncode == OK, again.stderr[-3000:]
    assert_models_equal(reference / "model.pt", run_dir / "model.pt")


def beat(run_dir: Path, rank: int) -> dict:
    path = run_dir / "progress" / f"rank-{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.extended  # CI's budget: the watchdog's dump and retry stay in CI on Slurm (test_slurm_ops_cluster's
# test_a_hang_is_dumped_requeued_once_and_resumed) and across netns nodes (faults' link-cut test)
@pytest.mark.timeout(600)
def test_a_sigstopped_rank_ends_as_hung_with_stacks_and_the_rerun_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Long enough that the run is still training when the rank is stopped, however loaded the host.
    recipe = [a if a != "train.epochs=8" else "train.epochs=24" for a in RECIPE]
    argv = launcher_argv("torchlaunch.agent", *recipe, f"run_dir={run_dir}", "--hang-timeout", "5")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (committed(run_dir) and beat(run_dir, 1).get("pid") and (beat(run_dir, 0).get("step") or 0) > 0):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        first = beat(run_dir, 0)["step"]
        while (beat(run_dir, 0).get("step") or 0) <= first:  # status' step grows while it runs
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        assert "state:      running" in ops("status", str(run_dir)).stdout
        os.kill(int(beat(run_dir, 1)["pid"]), signal.SIGSTOP)
        _, err = proc.communicate(timeout=5 + 60 + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == FAILURE, err[-3000:]
    dumps = sorted((run_dir / "hangs").glob("*/rank-*.txt"))
    assert any(p.name == "rank-0.txt" and "File " in p.read_text() for p in dumps), [p.read_text()[:500] for p in dumps]
    assert any(p.name == "rank-1.txt" for p in dumps)
    assert "state:      hung" in ops("status", str(run_dir)).stdout
    # The rerun only has to resume: a 5 s watchdog would also judge a step slowed by a loaded host.
    rerun = [*argv[:-1], "120"]
    again = subprocess.run(rerun, cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert again.returncode == OK, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr


@pytest.mark.timeout(600)
@pytest.mark.extended  # in CI: a hang's dump names the blocking line (test_ops_launcher_hang.py), a hung launch
# is recorded and its rerun resumes (the SIGSTOP test above)
def test_a_data_plugin_blocking_on_rank_1_ends_as_hung_with_the_blocking_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    data = ["data.name=tests.programs.blocking_data:blobs", "data.loader=pil", "data.num_workers=0"]
    argv = launcher_argv(
        "torchlaunch.agent",
        *RECIPE,
        *data,
        f"run_dir={run_dir}",
        "--hang-timeout",
        "5",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=5 + 60 + 240, check=False)
    assert done.returncode == FAILURE, done.stderr[-3000:]
    stacks = [p.read_text() for p in (run_dir / "hangs").glob("*/rank-1.txt")]
    assert any("BLOCKING LINE" in s or "blocking_data.py" in s for s in stacks), stacks
    assert "state:      hung" in ops("status", str(run_dir)).stdout
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=5 + 60 + 240, check=False)
    assert "resumed from" in again.stdout + again.stderr  # from the last commit before the hang (it blocks again)
    assert again.returncode == FAILURE
