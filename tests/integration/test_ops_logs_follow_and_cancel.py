"""`python -m launch logs` (rank files merged in time order with [rank N] prefixes, --rank, --follow),
the per-rank tee that writes them (keeps a crashing rank's last lines), and `cancel` for a local
launcher (a real process signalled), Slurm (scancel, faked on PATH) and Kubernetes (the command printed)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv
from torchlaunch import contract
from torchlaunch.jobs import cli, ranklog, record

HOST = socket.gethostname()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def write_log(run: Path, rank: int, lines: list[tuple[float, str]]) -> None:
    path = ranklog.log_path(run, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for when, text in lines:
            f.write(ranklog.stamp(when) + b" " + text.encode() + b"\n")


def logs(*args: str) -> tuple[int, list[str]]:
    out = io.StringIO()
    code = cli.main(["logs", *args], out=out)
    return code, out.getvalue().splitlines()


def test_logs_follow_prints_new_lines_and_ends_with_the_job(tmp_path: Path) -> None:
    rec = record.JobRecord(launch_id="F1", started=time.time())
    from torchlaunch.rundir import write_json

    write_json(record.record_path(tmp_path), rec.to_json())
    write_log(tmp_path, 0, [(1.0, "before")])
    follower = subprocess.Popen(
        launcher_argv("launch", "logs", str(tmp_path), "--follow"),
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline() == "[rank 0] before\n"
        write_log(tmp_path, 1, [(2.0, "after")])
        assert follower.stdout.readline() == "[rank 1] after\n"
        record.finish(tmp_path, rec, 0, "finished")
        assert follower.wait(timeout=60) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=30)


TEE_CHILD = """\
import os, sys
from pathlib import Path
from torchlaunch.jobs import ranklog
ranklog.start_tee(Path(sys.argv[1]))
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.stdout.write("no newline at the end")
sys.stdout.flush()
os.kill(os.getpid(), 9)
"""


def test_the_tee_keeps_a_killed_ranks_output(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "rank-0.log"
    done = subprocess.run(
        [sys.executable, "-c", TEE_CHILD, str(log)], env=env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -9
    assert done.stdout == "to stdout\nno newline at the end" and done.stderr == "to stderr\n"
    deadline = time.monotonic() + 60
    while "no newline" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.02)  # the tee drains after the rank died: poll its file under a deadline
    lines = log.read_text().splitlines()
    assert [ln.split(" ", 1)[1] for ln in lines] == ["to stdout", "to stderr", "no newline at the end"]
    assert all(ranklog.STAMP.match(ln.encode()) for ln in lines)


def test_a_rank_that_fails_at_once_has_its_last_lines_out_before_it_ends(tmp_path: Path) -> None:
    """The launcher reports a rank's end the moment it comes, and a pod or a Slurm step ends with it,
    taking the tee along: a rank failing right after its tee started (before the tee's interpreter was
    up) lost its traceback from the pod's log. The rank waits for its tee to drain before it ends."""
    program = tmp_path / "fails.py"
    program.write_text("raise ValueError('the last words of rank 1')\n")
    console = tmp_path / "console.txt"
    rank_env = {**env(), contract.LOGS_DIR: str(tmp_path / "logs"), contract.RANK_PREFIX: "1", "RANK": "1"}
    with console.open("wb") as sink:
        rank = subprocess.Popen(
            [sys.executable, "-m", "torchlaunch.runner", str(program)],
            env=rank_env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
        )
        assert rank.wait(timeout=120) == 1
    shown = console.read_text()  # read the moment the rank has ended: no tee may still be copying
    assert "[rank 1] ValueError: the last words of rank 1" in shown, shown
    logged = ranklog.log_path(tmp_path, 1).read_text()
    assert "ValueError: the last words of rank 1" in logged, logged


LAUNCHER = """\
import os, signal, subprocess, sys
from torchlaunch.jobs import proof, record
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
token = proof.new_token()  # as jobs.launcher.Operation does: the child holds it, the record its digest
child = subprocess.Popen(["sleep", "300"], env={**os.environ, proof.TOKEN_ENV: token})
rec = record.start(sys.argv[1], scheduler="local", command=["python", "-m", "launch.local"], launch_id="LC1", token=token)
print("ready", flush=True)
signal.sigwait({signal.SIGTERM})
outcome = "cancelled" if record.cancel_requested(sys.argv[1], rec.launch_id) else "preempted"
record.finish(sys.argv[1], rec, 75, outcome, "stopped with a committed checkpoint")
child.kill()
"""


def status(run: Path) -> dict:
    out = io.StringIO()
    assert cli.main(["status", str(run), "--json", "--no-scheduler"], out=out) == 0
    return json.loads(out.getvalue())


def test_cancel_a_local_launch(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)], env=env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert status(tmp_path)["state"] == "running"
        out = io.StringIO()
        assert cli.main(["cancel", str(tmp_path), "--dry-run"], out=out) == 0
        assert f"kill -TERM {child.pid}" in out.getvalue() and child.poll() is None
        out = io.StringIO()
        assert cli.main(["cancel", str(tmp_path)], out=out) == 0
        assert f"asked launcher pid {child.pid}" in out.getvalue()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert status(tmp_path)["state"] == "cancelled"
    assert record.cancel_requested(tmp_path, "LC1") and not record.cancel_requested(tmp_path, "LATER")
    out = io.StringIO()
    assert cli.main(["cancel", str(tmp_path)], out=out) == 0 and "already cancelled" in out.getvalue()


def fake_tools(folder: Path, squeue: str = "", sacct: str = "", stdout: str = "/elsewhere/out") -> Path:
    """scancel/squeue/sacct stand-ins that log their argv (squeue -O StdOut answers `stdout`). A
    stand-in: these tests forge records; test_slurm_ops_cluster runs the real cluster."""
    folder.mkdir()
    for name, answer in (("scancel", ""), ("squeue", squeue), ("sacct", sacct)):
        tool = folder / name
        body = f'echo "$0 $*" >> {folder}/calls\n'
        if name == "squeue":
            body += f'case "$*" in *StdOut*) echo "{stdout}"; exit 0;; esac\n'
        tool.write_text(f'#!/bin/sh\n{body}printf "{answer}"\n')
        tool.chmod(0o755)
    return folder / "calls"


def slurm_record(run: Path, job_id: str) -> None:
    from torchlaunch.rundir import write_json

    rec = record.JobRecord(launch_id="S1", scheduler="slurm", job_id=job_id, host="node7", started=time.time())
    write_json(record.record_path(run), rec.to_json())


def test_cancel_a_slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    calls = fake_tools(tmp_path / "bin", squeue="RUNNING\\n", stdout=f"{run}/slurm/%j/%j_0_log.out")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    slurm_record(run, "4242")
    out = io.StringIO()
    assert cli.main(["cancel", str(run)], out=out) == 0
    assert "scancel 4242" in out.getvalue()
    assert f"{tmp_path}/bin/scancel 4242" in calls.read_text().splitlines()
    assert record.cancel_requested(run, "S1")
    (tmp_path / "bin" / "squeue").write_text("#!/bin/sh\n")  # the job left the queue
    (tmp_path / "bin" / "sacct").write_text('#!/bin/sh\nprintf "CANCELLED by 1000\\n"\n')
    out = io.StringIO()
    assert cli.main(["status", str(run), "--json"], out=out) == 0
    assert json.loads(out.getvalue())["state"] == "cancelled"


def test_cancel_a_kubernetes_job_prints_the_command(tmp_path: Path) -> None:
    from torchlaunch.rundir import write_json

    rec = record.JobRecord(launch_id="K1", scheduler="k8s", job_id="cifar-run", extra={"namespace": "ml"})
    write_json(record.record_path(tmp_path), rec.to_json())
    out = io.StringIO()
    assert cli.main(["cancel", str(tmp_path)], out=out) == 0
    assert "run this to stop it: kubectl delete job cifar-run --wait=false --namespace ml" in out.getvalue()
    lighthouse = "kubectl delete deployment,service,networkpolicy cifar-run-lighthouse --ignore-not-found"
    assert f"{lighthouse} --wait=false --namespace ml" in out.getvalue()  # live mode's service, if any
    assert record.cancel_requested(tmp_path, "K1")


def test_status_asks_squeue_and_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchlaunch.rundir import write_json

    fake_tools(tmp_path / "bin", squeue="PENDING\\n")
    kubectl = tmp_path / "bin" / "kubectl"
    job = {"status": {"active": 2, "ready": 2}}
    kubectl.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {tmp_path}/bin/calls\necho '{json.dumps(job)}'\n")
    kubectl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    slurm_run, k8s_run = tmp_path / "s", tmp_path / "k"
    slurm_record(slurm_run, "99")
    rec = record.JobRecord(launch_id="K2", scheduler="k8s", job_id="cifar-run", extra={"namespace": "ml"})
    write_json(record.record_path(k8s_run), rec.to_json())
    assert status(slurm_run)["state"] == "running"  # --no-scheduler: the run dir alone
    out = io.StringIO()
    assert cli.main(["status", str(slurm_run), "--json"], out=out) == 0
    assert json.loads(out.getvalue())["state"] == "pending"
    out = io.StringIO()
    assert cli.main(["list", str(tmp_path)], out=out) == 0
    rows = {line.split()[0]: line.split()[1] for line in out.getvalue().splitlines()[1:]}
    assert rows == {"k": "running", "s": "pending"}
    calls = (tmp_path / "bin" / "calls").read_text()
    assert "kubectl get job cifar-run -o json --namespace ml" in calls and "squeue -h -j 99 -o %T" in calls
    job["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    kubectl.write_text(f"#!/bin/sh\necho '{json.dumps(job)}'\n")
    out = io.StringIO()
    assert cli.main(["status", str(k8s_run), "--json"], out=out) == 0
    assert json.loads(out.getvalue())["state"] == "failed"
