"""launch.slurm's jobs are operable through the run dir on a real cluster (slurm/dev-cluster.sh): `python -m
launch status` names the job and its state, `cancel` stops it without a requeue, a hung rank is dumped, the
job requeued once and resumed, and a failed job's --wait shows the failing rank's stderr."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv
from tests.engines.test_slurm_cluster import (
    DEV_CLUSTER,
    ONE_PER_NODE,
    SMOKE,
    Launch,
    assert_clean_cancel,
    requeue_records,
    wait_until,
)
from torchlaunch.jobs import ranklog

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster() -> str:
    """The running dev cluster's slurm.conf (skip when it is down: these tests never start or stop it)."""
    if subprocess.run(["bash", str(DEV_CLUSTER), "status"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("the Slurm dev cluster is not up (slurm/dev-cluster.sh up)")
    out = subprocess.run(["bash", str(DEV_CLUSTER), "env"], capture_output=True, text=True, timeout=60).stdout
    conf = out.strip().split("SLURM_CONF=", 1)[1].split()[0]
    os.environ["SLURM_CONF"] = conf
    return conf


STEPPER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    from torchlaunch.jobs.progress import heartbeat
    run, total, hang = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "hang"
    rank = int(os.environ["RANK"])
    state = run / f"step-{rank}.txt"
    start = int(state.read_text()) if state.exists() else 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print(f"rank {rank} starts at {start}", flush=True)
    for step in range(start, total):
        if stop:
            sys.exit(75)  # everything done so far is in step-N.txt: a committed checkpoint
        if hang and rank == 1 and step == 4 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            print("rank 1 hangs", flush=True)
            while True:
                time.sleep(1)  # a deadlock: no progress, deaf to the stop flag
        time.sleep(0.3)
        state.write_text(str(step + 1))
        heartbeat(step + 1, total=total)
    print(f"rank {rank} done at {total}", flush=True)
    """
)

FAILER = textwrap.dedent(
    """
    import os, sys
    if os.environ["RANK"] == "1":
        raise ValueError("You set devices=2 but this node has 1. HINT: Set devices=1")
    """
)


def launch_cmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(launcher_argv("launch", *args), cwd=REPO, capture_output=True, text=True, timeout=120)


def status(run_dir: Path) -> dict:
    done = launch_cmd("status", str(run_dir), "--json")
    return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}


def program_launch(run_dir: Path, script: Path, *args: str, extra: tuple[str, ...] = ()) -> Launch:
    """Launch's helper appends `run_dir=`; a program takes --run-dir, so run launch.slurm directly."""
    launch = Launch.__new__(Launch)
    launch.run_dir = run_dir
    launch.output = run_dir.parent / f"{run_dir.name}.launcher.log"
    argv = ["--nodes", "2", "--tasks-per-node", "1", "--time", "10", *extra, "--run-dir", str(run_dir), "--wait"]
    with open(launch.output, "w") as out:
        launch.proc = subprocess.Popen(
            launcher_argv("torchlaunch.backends.slurm.launch", *argv, "--", str(script), *args),
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    return launch


@pytest.mark.timeout(300)
def test_status_names_the_job_and_cancel_does_not_requeue(cluster: str, tmp_path: Path) -> None:
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    run_dir = tmp_path / "run"
    launch = program_launch(run_dir, script, str(run_dir), "100000", "no")
    job_id = launch.job_id
    seen = wait_until(lambda: (s := status(run_dir)).get("state") == "running" and s, 120, "state running")
    assert (seen["scheduler"], seen["job_id"]) == ("slurm", job_id)
    # Both ranks stepping (Slurm says RUNNING before the tasks start): the cancel meets the program.
    wait_until(lambda: all((run_dir / f"step-{r}.txt").exists() for r in (0, 1)), 120, "both ranks' first step")
    done = launch_cmd("cancel", str(run_dir))
    assert done.returncode == 0 and f"scancel {job_id}" in done.stdout, done.stdout + done.stderr
    assert launch.finish(120) != 0
    assert wait_until(lambda: status(run_dir).get("state") == "cancelled", 60, "state cancelled")
    assert "REQUEUED" not in " ".join(requeue_records(job_id))
    assert_clean_cancel(run_dir, job_id, 2, "python -m launch cancel")


@pytest.mark.timeout(300)
def test_a_cancel_while_the_tasks_start_ends_the_job_without_a_requeue(cluster: str, tmp_path: Path) -> None:
    """`launch cancel` as soon as the tasks have recorded the job: the built-in worker is still
    importing torch, before its stop handler is in place. Before, submitit's SIGUSR2 handler was the
    one there: it requeued the job, which trained again after the cancel (seen in a CI-like run)."""
    run_dir = tmp_path / "run"
    launch = Launch(run_dir, *ONE_PER_NODE, "--time", "10", *SMOKE)
    job_id = launch.job_id
    wait_until(lambda: len(list((run_dir / "job").glob("node-*.json"))) == 2, 120, "both tasks' records")
    done = launch_cmd("cancel", str(run_dir))
    assert done.returncode == 0 and f"scancel {job_id}" in done.stdout, done.stdout + done.stderr
    assert launch.finish(120) != 0
    assert wait_until(lambda: status(run_dir).get("state") == "cancelled", 60, "state cancelled")
    states = requeue_records(job_id)
    assert "REQUEUED" not in " ".join(states) and len(states) == 1, states
    logs = assert_clean_cancel(run_dir, job_id, 2, "python -m launch cancel")
    assert "was cancelled (python -m launch cancel), not requeued" in logs, logs[-3000:]


@pytest.mark.timeout(400)
def test_a_hang_is_dumped_requeued_once_and_resumed(cluster: str, tmp_path: Path) -> None:
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    run_dir = tmp_path / "run"
    launch = program_launch(run_dir, script, str(run_dir), "12", "hang", extra=("--hang-timeout", "6"))
    code = launch.finish(300)
    text = launch.text()
    assert code == 0, text[-3000:]
    assert (run_dir / "step-1.txt").read_text() == "12" and (run_dir / "step-0.txt").read_text() == "12"
    dumps = list((run_dir / "hangs").glob("*"))
    assert len(dumps) == 1, f"one stack dump expected under {run_dir / 'hangs'}: {dumps}"
    states = requeue_records(launch.job_id)
    assert states.count("REQUEUED") == 1 and states[-1] == "COMPLETED", states
    logs = "".join(p.read_text() for p in (run_dir / "slurm" / launch.job_id).glob("*_log.err"))
    assert "hang: job" in logs and "requeued (1/1)" in logs
    assert re.search(r"rank 1 starts at [1-9]", "".join(p.read_text() for p in run_dir.glob("slurm/*/*_log.out")))


@pytest.mark.timeout(300)
def test_a_failed_job_shows_the_failing_ranks_stderr(cluster: str, tmp_path: Path) -> None:
    script = tmp_path / "failer.py"
    script.write_text(FAILER)
    run_dir = tmp_path / "run"
    launch = program_launch(run_dir, script)
    assert launch.finish(200) == 1
    text = launch.text()
    assert re.search(r"first failing: rank 1 on \S+", text), text[-3000:]
    assert "HINT: Set devices=1" in text and f"all logs: {run_dir / 'slurm' / launch.job_id}" in text


CHATTY_FAILER = textwrap.dedent(
    """\
    import os, sys
    print(f"hello from {os.environ['RANK']}", flush=True)
    if os.environ["RANK"] == "1":
        raise ValueError("You set devices=2 but this node has 1. HINT: Set devices=1")
    """
)


@pytest.mark.timeout(300)
def test_console_options_reach_the_tasks_and_the_failure_tail_survives_them(cluster: str, tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY_FAILER)
    run_dir = tmp_path / "run"
    launch = program_launch(run_dir, script, extra=("--rank-prefix", "--console-ranks", "0"))
    assert launch.finish(200) == 1
    text = launch.text()
    outs = {p.name: p.read_text() for p in (run_dir / "slurm" / launch.job_id).glob("*_log.out")}
    assert any("[rank 0] hello from 0\n" in out for out in outs.values()), outs
    assert not any("hello from 1" in out for out in outs.values()), outs  # off rank 1's console
    assert "hello from 1" in ranklog.log_path(run_dir, 1).read_text()  # but in its log
    assert ranklog.log_path(run_dir, 0).read_text().count("hello from 0") == 1  # one tee per task, no echo
    assert re.search(r"first failing: rank 1 on \S+; last lines of \S+/logs/rank-1.log", text), text[-3000:]
    assert "HINT: Set devices=1" in text
