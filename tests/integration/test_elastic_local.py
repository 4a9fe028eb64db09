"""Degraded restart on one host: two launch.local launchers on loopback are two "nodes" of one elastic
job (--nnodes 1:2). One launcher's process group is SIGKILLed mid-run (a node lost); the survivor's
torchrun re-forms the group on one node and the worker resumes from the last committed checkpoint on
world size 1; then a new launcher joins (the node returns), the running rank commits a checkpoint on
the agent's SIGTERM and the group grows back to 2. Every global step, on every world size it ran on,
drew exactly the samples, crop offsets and flips of an uninterrupted run (batch traces). Real torchrun,
real c10d rendezvous, CPU + gloo; nothing is mocked. Timeouts are deadlines on polled files, never sleeps.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import free_port, launcher_argv
from tests.helpers import REPO
from tests.library import RunLibrary
from torchlaunch.exit_codes import CANCELLED

BATCH = 48
STEPS_PER_EPOCH = 10
EPOCHS = 3
TOTAL = STEPS_PER_EPOCH * EPOCHS
RECIPE = [
    "--config",
    "configs/smoke.yaml",
    f"data.synthetic_train_size={BATCH * STEPS_PER_EPOCH}",
    "data.synthetic_val_size=48",
    "model.width=4",
    f"train.batch_size={BATCH}",
    f"train.epochs={EPOCHS}",
    "train.log_every_steps=5",
    "checkpoint.every_steps=3",
    "debug.trace_batches=true",
]
RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=4"
"""A lost node is seen within ~3 s and a group forms ~4 s after its first node (torchrun: 15 s and 30 s)."""
DEADLINE_S = 240.0


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_node(run_dir: Path, port: int, log: Path) -> subprocess.Popen:
    """One "node": a launcher in a process group of its own (so the whole node can be SIGKILLed)."""
    argv = launcher_argv(
        "torchlaunch.agent",
        "--device",
        "cpu",
        "--nnodes",
        "1:2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--max-restarts",
        "3",
        "--rdzv-conf",
        RDZV,
        *RECIPE,
        f"run_dir={run_dir}",
        "recovery.live=false",  # the subject: torchrun's elastic restart (the live road: test_live_range_two_nodes.py)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(what: str, condition: Callable[[], bool], nodes: list[subprocess.Popen], logs: list[Path]) -> None:
    """Poll `condition` until DEADLINE_S; fail early (with the logs) if a node ended meanwhile."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        ended = [p.poll() for p in nodes]
        if any(c is not None for c in ended) and not condition():
            pytest.fail(f"waiting for {what}: a node ended {ended}\n{tails(logs)}")
        if time.monotonic() > deadline:
            pytest.fail(f"waiting for {what}: not within {DEADLINE_S} s\n{tails(logs)}")
        time.sleep(0.05)  # polling a file under a deadline, not synchronising on time


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def rank_pids(launcher_pid: int) -> list[int]:
    """The live ranks under one launcher (launcher -> torchrun's agent -> ranks)."""
    found = []
    for agent in children(launcher_pid):
        for pid in children(agent):
            try:
                if b"torchlaunch.runner" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
    return found


def sigterm_pending(pid: int) -> bool:
    """The (stopped) process has a SIGTERM waiting: torchrun's agent asked it to stop."""
    bit = 1 << (signal.SIGTERM - 1)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & bit:
            return True
    return False


def tails(logs: list[Path]) -> str:
    return "\n".join(f"==> {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


def records(run_dir: Path) -> list[dict]:
    """Every batch-trace record any rank wrote (a SIGKILLed rank's last line may be cut: skipped)."""
    out = []
    for f in sorted((run_dir / "trace").glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append({**json.loads(line), "file": f.name})
            except json.JSONDecodeError:
                continue
    return out


def newest_world(run_dir: Path) -> tuple[int, int]:
    """(highest traced step, the world size of the newest record): where the job is now."""
    found = records(run_dir)
    if not found:
        return 0, 0
    written = {r["file"] for r in found}  # a file just created may hold no whole record yet
    mtimes = {f.name: f.stat().st_mtime for f in (run_dir / "trace").glob("rank*.jsonl") if f.name in written}
    newest_file = max(mtimes, key=mtimes.get)
    last = [r for r in found if r["file"] == newest_file][-1]
    return max(r["step"] for r in found), last["world_size"]


def samples(rec: dict) -> list[tuple]:
    """(index, crop offset, flip) of every sample of one record."""
    return list(zip(rec["indices"], rec["dy"], rec["dx"], rec["flip"], strict=True))


def by_step(found: list[dict]) -> dict[int, dict[int, list]]:
    """step -> world size -> [(samples, file)]: what every world size that ran the step drew."""
    out: dict[int, dict[int, list]] = {}
    for rec in found:
        out.setdefault(rec["step"], {}).setdefault(rec["world_size"], []).append((samples(rec), rec["file"]))
    return out


def check_same_samples(reference: dict[int, list], found: list[dict]) -> set[int]:
    """Every record drew only samples of the uninterrupted run's step, with its crops and flips, and in
    every step some world size w drew all of them in w shares (the run that counted); the world sizes
    seen."""
    seen_worlds: set[int] = set()
    for step, worlds in sorted(by_step(found).items()):
        want = reference[step]
        complete = False
        for world, shares in worlds.items():
            seen_worlds.add(world)
            drawn = [s for share, _ in shares for s in share]
            assert set(drawn) <= set(want), f"step {step} on world size {world}: samples not in the reference"
            assert all(len(share) == BATCH // world for share, _ in shares), f"step {step}: uneven shares"
            # a step redone after a loss appears twice per file; the last `world` shares are one run of it
            if sorted(drawn[-BATCH:]) == want or sorted(drawn) == want:
                complete = True
        assert complete, f"step {step}: no world size drew the whole global batch {sorted(worlds)}"
    assert sorted(by_step(found)) == sorted(reference)
    return seen_worlds


@pytest.fixture(scope="module")
def reference(run_library: RunLibrary) -> dict[int, list]:
    """The uninterrupted run's samples per global step (one rank: the order is the world size's to keep).
    The run is the session's library entry "elastic" (its exit code asserted where it is built,
    tests/library.py), read only, shared with tests/engines/test_elastic_slurm.py."""
    run_dir = run_library.path("elastic")
    out: dict[int, list] = {}
    for rec in records(run_dir):
        out.setdefault(rec["step"], []).extend(samples(rec))
    assert sorted(out) == list(range(1, TOTAL + 1))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.extended  # a node lost and back with the same samples, on netns nodes: test_elastic_netns.py, in CI
def test_node_lost_then_returns_same_samples(tmp_path: Path, reference: dict[int, list]) -> None:
    run_dir = tmp_path / "run"
    port = free_port()
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log", tmp_path / "node-b2.log"]
    a = start_node(run_dir, port, logs[0])
    nodes = [a]
    try:
        wait_for("node A's rendezvous store", lambda: listening(port), nodes, logs)
        b = start_node(run_dir, port, logs[1])  # A binds first: A hosts the store, B is the node to lose
        nodes.append(b)
        wait_for(
            "training on 2 nodes past a checkpoint",
            lambda: newest_world(run_dir)[1] == 2 and newest_world(run_dir)[0] >= 8,
            nodes,
            logs,
        )
        os.killpg(b.pid, signal.SIGKILL)  # node B is lost: its launcher, agent and ranks at once
        b.wait(timeout=30)
        lost_at = newest_world(run_dir)[0]
        assert lost_at < TOTAL, "the run finished before the node was lost: make it longer"
        nodes.remove(b)
        wait_for(
            "training on the node left",
            lambda: newest_world(run_dir)[1] == 1 and newest_world(run_dir)[0] > lost_at,
            nodes,
            logs,
        )
        # Hold the survivor's rank still (SIGSTOP) while the node starts again, so it cannot finish first;
        # let it go on once torchrun's agent, seeing the node waiting, has sent it SIGTERM.
        (survivor,) = rank_pids(a.pid)
        os.kill(survivor, signal.SIGSTOP)
        one_at = newest_world(run_dir)[0]
        seen = job_status(run_dir)  # the job trains on the node left: one job, running, degraded
        assert seen["state"] == "running" and "degraded: 1 of 2 nodes" in seen["reason"], seen
        assert "launcher gone" in seen["reason"], seen  # names the lost node
        assert one_at < TOTAL - 5, "the survivor finished before the node came back: make the run longer"
        b2 = start_node(run_dir, port, logs[2])  # the node returns
        nodes.append(b2)
        wait_for("the agent's SIGTERM to the running rank", lambda: sigterm_pending(survivor), nodes, logs)
        os.kill(survivor, signal.SIGCONT)
        wait_for(
            "the group grown back to 2",
            lambda: newest_world(run_dir)[1] == 2 and newest_world(run_dir)[0] > one_at,
            nodes,
            logs,
        )
        codes = [p.wait(timeout=DEADLINE_S) for p in (a, b2)]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert codes == [0, 0], tails(logs)
    worlds = check_same_samples(reference, records(run_dir))
    assert worlds == {1, 2}
    text = logs[0].read_text()
    committed = re.findall(r"preempted: checkpoint committed at global step (\d+)", text)
    resumed = re.findall(r"resumed from \S+ at epoch \d+/\d+ step \d+/\d+ \(global step (\d+)\)", text)
    assert len(committed) == 1, tails(logs)  # growing back: the running rank committed on the agent's SIGTERM
    assert resumed[-1] == committed[0], tails(logs)  # and the grown group went on from there: no lost work
    assert not (run_dir / ".lock.json").exists(), "the last node to leave removes the run-dir lock"


def job_status(run_dir: Path) -> dict:
    """`python -m launch status --json RUN_DIR`, as a user asks it (in-process: the same code)."""
    import io

    from torchlaunch.jobs import cli as jobs_cli

    out = io.StringIO()
    assert jobs_cli.main(["status", "--json", "--no-scheduler", str(run_dir)], out) == 0
    return json.loads(out.getvalue())


@pytest.mark.slow
def test_cancel_stops_every_node_of_an_elastic_job(tmp_path: Path) -> None:
    """`cancel` on a job of two `--nnodes 1:2` launchers: both checkpoint at one agreed step and end
    cancelled (exit 3), and the job says so. On 9d2744e it stopped one launcher; the other re-formed
    alone and trained on while `status` said cancelled, and a second cancel found nothing to stop."""
    from torchlaunch.jobs import cli as jobs_cli

    run_dir = tmp_path / "run"
    port = free_port()
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    a = start_node(run_dir, port, logs[0])
    nodes = [a]
    try:
        wait_for("node A's rendezvous store", lambda: listening(port), nodes, logs)
        nodes.append(start_node(run_dir, port, logs[1]))
        wait_for(
            "training on 2 nodes", lambda: newest_world(run_dir)[1] == 2 and newest_world(run_dir)[0] >= 2, nodes, logs
        )
        out = io.StringIO()
        assert jobs_cli.main(["cancel", str(run_dir)], out) == 0, out.getvalue()
        assert out.getvalue().count("asked launcher pid") == 2, out.getvalue()
        codes = [p.wait(timeout=DEADLINE_S) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert codes == [CANCELLED, CANCELLED], tails(logs)
    assert job_status(run_dir)["state"] == "cancelled"
    out = io.StringIO()
    assert jobs_cli.main(["cancel", str(run_dir)], out) == 0
    assert "already cancelled" in out.getvalue()
    steps = {int(s) for s in re.findall(r"checkpoint committed at global step (\d+)", tails(logs))}
    assert len(steps) == 1, tails(logs)  # one agreed step for both nodes
