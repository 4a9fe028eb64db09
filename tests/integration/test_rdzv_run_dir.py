"""A user's own script under torchrun's contract survives the loss of the node of rank 0 (issue 54, item 5):
two `launch.local --nnodes 1:2 --run-dir RUN` launchers on one host share one run dir, where their agents
rendezvous (launch.rdzv_file); the launcher whose node is rank 0 (it served the workers' store) is
SIGKILLed with its whole process group mid-run. The survivor's agent re-forms the group alone, restarts
its worker, which resumes from the script's checkpoint and finishes with exactly the value of an
uninterrupted run. With torchrun's c10d store on that node instead, the survivor exits 1 (issue 54's table).
Real torchrun, CPU + gloo, nothing mocked; waits are deadlines on polled files."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import launcher_argv, run_proc
from tests.helpers import REPO
from tests.integration.test_elastic_local import DEADLINE_S, children, tails, wait_for
from torchlaunch import status
from torchlaunch.exit_codes import BAD_INPUT, OK
from torchlaunch.launch import rdzv_file

PROGRAM = REPO / "tests" / "programs" / "allreduce_steps.py"
STEPS = 200
"""0.1 s a step: a node that arrives late on a loaded machine finds the first one still training (its
group of 1 then grows to 2, as it must), and the loss comes with most of the run left."""
RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=10"
"""A lost node is seen within ~3 s; a group waits 10 s for a second node (it forms at once when both are in)."""


def start_node(run_dir: Path, state: Path, log: Path) -> subprocess.Popen:
    """One "node": a launcher in a process group of its own (so the whole node can be SIGKILLed)."""
    argv = launcher_argv(
        "launch.local",
        "--device",
        "cpu",
        "--nnodes",
        "1:2",
        "--max-restarts",
        "3",
        "--rdzv-conf",
        RDZV,
        "--run-dir",
        str(run_dir),
        "--",
        str(PROGRAM),
        str(state),
        str(STEPS),
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def checkpoint(state: Path) -> dict:
    try:
        return json.loads((state / "state.json").read_text())
    except (OSError, ValueError):  # not written yet (the rename makes it whole once it is)
        return {}


def starts(state: Path) -> list[dict]:
    path = state / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def expected(steps: int) -> int:
    spec = importlib.util.spec_from_file_location("allreduce_steps", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.expected(steps)


@pytest.mark.slow
def test_user_script_survives_the_loss_of_the_rank_0_node(tmp_path: Path) -> None:
    run_dir, state = tmp_path / "run", tmp_path / "state"
    state.mkdir()
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    nodes = [start_node(run_dir, state, logs[0]), start_node(run_dir, state, logs[1])]
    try:
        wait_for(
            "training on 2 nodes past step 10",
            lambda: checkpoint(state).get("world") == 2 and checkpoint(state)["step"] >= 10,
            nodes,
            logs,
        )
        pair = {s["rank"]: s["agent"] for s in starts(state) if s["world"] == 2}  # the group of 2 (its last)
        (lost,) = [p for p in nodes if pair[0] in children(p.pid)]  # the rank 0 node serves the workers' store
        (survivor,) = [p for p in nodes if p is not lost]
        before = len(starts(state))
        os.killpg(lost.pid, signal.SIGKILL)  # the node is lost: its launcher, agent and rank at once
        lost.wait(timeout=30)
        lost_at = checkpoint(state)["step"]
        assert lost_at < STEPS, "the run finished before the node was lost: make it longer"
        code = survivor.wait(timeout=DEADLINE_S)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert code == OK, tails(logs)
    final = checkpoint(state)
    assert final == {"step": STEPS, "value": expected(STEPS), "world": 1}, tails(logs)
    alone = starts(state)[before:]
    assert len(alone) == 1 and alone[0]["world"] == 1, starts(state)  # one restart, on the node left
    assert alone[0]["agent"] == pair[1], starts(state)  # by the survivor's agent: it re-formed the group
    assert alone[0]["step"] >= lost_at and alone[0]["rank"] == 0, starts(state)  # resumed, rank 0 now
    assert not (run_dir / ".lock.json").exists(), "the last node to leave removes the run-dir lock"


def test_the_agent_refuses_a_forged_state_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    """torchrun's agent (the wrapper launch.local runs) on a run dir whose rendezvous state was written by
    a stranger, a pickle that would run code: exit 2, the reason as rank 0's status record (what the
    launcher prints), no traceback, nothing unpickled and no worker started."""
    run_dir, status_dir, marker = tmp_path / "run", tmp_path / "status", tmp_path / "ran"
    status_dir.mkdir()
    forged = rdzv_file.MAGIC + (3).to_bytes(8, "big") + os.urandom(32) + pickle.dumps(RunsCode(str(marker)))
    (run_dir / "rdzv").mkdir(parents=True)
    (run_dir / "rdzv" / "tl-forged.0.state").write_bytes(forged)
    argv = launcher_argv(
        "torchlaunch.launch.torchrun",
        *("--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1"),
        *("--rdzv-backend", rdzv_file.BACKEND, "--rdzv-endpoint", str(run_dir), "--rdzv-id", "tl-forged"),
        *("-m", "torchlaunch.runner", str(PROGRAM), str(tmp_path / "state"), "1"),
    )
    env = {"PYTHONPATH": str(REPO), status.STATUS_DIR_ENV: str(status_dir), status.ATTEMPT_ENV: "a1"}
    done = run_proc(argv, timeout=120, env=env)
    assert done.returncode == BAD_INPUT, done.stderr[-3000:]
    record = json.loads((status_dir / "a1-rank0.json").read_text())
    assert record["code"] == BAD_INPUT and "does not carry this run's seal" in record["reason"]
    assert "\n" not in record["reason"] and "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "state").exists()  # nothing unpickled, no worker ran


class RunsCode:
    """Unpickled, it would create the file at `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))
