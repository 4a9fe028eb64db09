"""Live recovery on Slurm (slurm/dev-cluster.sh, two slurmd nodes on this host): `launch.slurm --nodes 2
--tasks-per-node 1 recovery.live=true recovery.lighthouse=...` with the membership service started here
on loopback (`python -m launch.lighthouse`). Once node n2's rank has traced step KILL_AT, every process
of the job on n2 is SIGKILLed (found by SLURM_JOB_ID and SLURMD_NODENAME in /proc/PID/environ) and n2
is set DOWN, as slurmctld marks a node that stopped answering: with sbatch and srun --no-kill the job
keeps n1, whose rank regroups in place and trains every step to the end in the same process.

Asserted: `--wait` exits 0 and Slurm says COMPLETED, not NODE_FAIL (the batch script's verdict: srun's 137 for the
lost task is not the job's); every global step's samples, crops and flips are those of an
uninterrupted run (bench/live.py's recipe under launch.local, 2 ranks); one regroup, to 1 rank; no
`resumed from`; `status` shows the run finished on 1 rank with rank 1 gone. n2 is set RESUME again
whatever happens. Both nodes share this host, so every store address is loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import live
from tests.conftest import REPO, launcher_argv, run_cmd
from tests.engines.test_slurm_cluster import Launch, requeue_records, slurm, wait_until
from tests.engines.test_slurm_cluster import cluster as dev_cluster  # the module fixture, shared
from tests.integration.test_live_recovery import step_samples

cluster = dev_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LOST = "n2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[str]:
    """`python -m launch.lighthouse` on loopback, apart from the job; its address once it serves."""
    port = free_port()
    log = tmp_path / "lighthouse.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launch.lighthouse",
                "--bind",
                f"127.0.0.1:{port}",
                "--heartbeat-timeout-ms",
                "1000",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: "lighthouse: serving" in log.read_text() or proc.poll() is not None, 60, "the service")
        assert proc.poll() is None, log.read_text()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> live.LiveRun:
    """The uninterrupted run (launch.local, 2 ranks, nothing killed): the plan does not depend on the world."""
    result = live.run(tmp_path_factory.mktemp("live-slurm-ref") / "run", victim=None)
    assert result.code == 0, result.stderr[-3000:]
    return result


def job_pids(job_id: str, node: str) -> list[int]:
    """Every process of the job on `node` (the task, its loader workers): Slurm exports both names to each."""
    want = {b"SLURM_JOB_ID=" + job_id.encode(), b"SLURMD_NODENAME=" + node.encode()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= environ:
            found.append(int(entry))
    return found


def kill_node(job_id: str, node: str) -> list[int]:
    """SIGKILL every process of the job on `node` until none is left (a process may fork meanwhile)."""
    killed: list[int] = []

    def none_left() -> bool:
        pids = job_pids(job_id, node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
        return not pids

    wait_until(none_left, 30, f"the job's processes on {node} to be gone", poll_s=0.05)
    return killed


@pytest.mark.timeout(600)
def test_a_lost_node_costs_a_regroup_and_the_job_completes(
    cluster: str, lighthouse: str, reference: live.LiveRun, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    recipe = tmp_path / "live.yaml"
    recipe.write_text(live.config_text(run_dir) + f"  lighthouse: {lighthouse}\n")
    launch = Launch(run_dir, "--nodes", "2", "--tasks-per-node", "1", "--time", "10", "--config", str(recipe))
    try:
        wait_until(
            lambda: (
                live.traced_step(run_dir / "trace" / "rank1.jsonl") >= live.KILL_AT or launch.proc.poll() is not None
            ),
            240,
            f"rank 1 to trace step {live.KILL_AT}",
            poll_s=0.02,
        )
        assert launch.proc.poll() is None, launch.text()[-3000:]
        survivor = live.pid_of(run_dir, 0)
        assert kill_node(launch.job_id, LOST)
        slurm("scontrol", "update", f"nodename={LOST}", "state=down", "reason=torchlaunch live test")
        code = launch.finish(300)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={LOST}", "state=resume"], capture_output=True, timeout=30)
    out = launch.text()
    assert code == 0, out[-3000:]
    # slurmdbd records the allocation that lost n2 as RESIZING (the node was removed from the job), then
    # the job's end: COMPLETED, never NODE_FAIL (what the job gets without --no-kill) nor a requeue.
    allocations = requeue_records(launch.job_id)
    assert allocations[-1] == "COMPLETED" and set(allocations) <= {"RESIZING", "COMPLETED"}, allocations
    assert "task(s) 1 lost (no outcome recorded); the others finished" in out, out[-3000:]
    assert "resumed from" not in out, "the job was restarted"
    assert live.pid_of(run_dir, 0) == survivor, "the survivor's process changed"
    events = [
        json.loads(line) for line in (run_dir / "live" / "events-rank0.jsonl").read_text().splitlines() if line.strip()
    ]
    regrouped = [(e["world"], e["rank"]) for e in events if e["event"] == "regrouped"]
    assert regrouped == [(1, 0)], events
    assert step_samples(run_dir) == step_samples(reference.run_dir)
    rc, shown, err = run_cmd(launcher_argv("launch", "status", str(run_dir), "--json"), timeout=60)
    assert rc == 0, err
    st = json.loads(shown)
    assert (st["state"], st["step"], st["world_size"]) == ("finished", live.STEPS, 1), st
    assert {r["rank"] for r in st["ranks"] if r["gone"]} == {1}, st["ranks"]
