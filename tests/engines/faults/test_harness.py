"""The harness itself, proved with plain torchrun and a tiny gloo all-reduce job (no trainer needed).

Preemption, worker restarts and long outages are covered against the real launcher in test_faults.py;
here: node identity, cleanup, orphans, node loss (the rerun finishes with the exact total) and
catching a checkpoint write mid-way.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults import netns, progress
from faults.inject import crash_during_checkpoint_write
from faults.job import Attempt, torchrun_argv

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

STEPS = 40
EXPECTED_TOTAL = float(2 * sum(range(1, STEPS + 1)))  # each step all-reduces `step` over 2 ranks
JOB = Path(__file__).with_name("allreduce_job.py")


def start_job(cluster, run_dir: Path, name: str, max_restarts: int = 0, **job_args: object) -> Attempt:
    run_dir.mkdir(exist_ok=True)
    script = [str(JOB), f"--run-dir={run_dir}", f"--steps={STEPS}"]
    script += [f"--{k.replace('_', '-')}={v}" for k, v in job_args.items()]
    return Attempt.start(cluster, lambda node: torchrun_argv(node, script, max_restarts), run_dir, name)


def total(run_dir: Path) -> float:
    return json.loads((run_dir / "result.json").read_text())["total"]


def steps_after_resume(run_dir: Path) -> list[int]:
    """Steps logged by the attempt after the first backwards jump (a resume) in metrics.jsonl."""
    steps = progress.train_steps(run_dir)
    for k in range(1, len(steps)):
        if steps[k] <= steps[k - 1]:
            return steps[k:]
    return []


def test_nodes_have_own_hostname_hosts_and_no_route_out(cluster):
    node0, node1 = cluster.nodes
    out = cluster.run(node1, ["sh", "-c", "hostname; getent hosts node0; ip route"]).stdout.splitlines()
    assert out[0] == "node1"
    assert out[1].split() == ["10.77.0.1", "node0"]
    assert not any(line.startswith("default") for line in out[2:])
    assert cluster.run(node0, ["hostname"]).stdout.strip() == "node0"
    unreachable = cluster.run(node0, ["ip", "route", "get", "1.1.1.1"])
    assert unreachable.returncode != 0 and "unreachable" in unreachable.stderr.lower()
    # The bind mount stayed private to the node: the host's /etc/hosts is untouched.
    assert "10.77.0.1 node0" not in Path("/etc/hosts").read_text()


def test_close_kills_orphans_and_deletes_namespaces(cluster, tmp_path):
    node0, node1 = cluster.nodes
    # A shell that backgrounds a sleeper and exits: the sleeper is orphaned, only the netns finds it.
    cluster.start(node0, ["sh", "-c", "sleep 600 & echo $! > orphan.pid"], tmp_path / "n0.log", cwd=tmp_path)
    cluster.start(node1, ["sleep", "600"], tmp_path / "n1.log")
    progress.wait_until(lambda: (tmp_path / "orphan.pid").exists() and len(node1.processes()) == 1, 10, "sleepers")
    orphan = int((tmp_path / "orphan.pid").read_text())
    progress.wait_until(lambda: node0.started[0].poll() is not None, 10, "the parent shell to exit")
    assert [p.pid for p in node0.processes()] == [orphan]
    cluster.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert node0.netns not in names and node1.netns not in names
    assert not Path(f"/proc/{orphan}").exists() or "Z" in Path(f"/proc/{orphan}/stat").read_text().split()[2]


def test_leftovers_of_a_dead_harness_are_removed(tmp_path):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.PREFIX}-{dead.pid}-0-node0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "600"])
    progress.wait_until(
        lambda: len(netns.procs.processes_in_netns(netns.procs.netns_inode(f"/run/netns/{name}"))) == 1, 10, "sleeper"
    )
    try:
        with netns.Cluster():
            assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        sleeper.kill()


@pytest.mark.extended  # a whole node killed, against the real launcher: test_faults.py, in CI's tier
def test_kill_whole_node_fails_bounded_then_rerun_resumes(cluster, tmp_path, rng):
    run_dir = tmp_path / "run"
    fault_step = rng.randint(12, STEPS - 10)
    attempt = start_job(cluster, run_dir, "first")
    progress.wait_for_step(run_dir, fault_step, 60, attempt.dead_reason)
    killed_at = time.monotonic()
    killed = cluster.kill_node(cluster.nodes[0])  # the agent hosting the store, and its worker
    assert len(killed) >= 2  # the agent and its worker at least
    assert cluster.nodes[0].processes() == []
    codes = attempt.wait(60)
    assert codes[1] != 0
    assert attempt.seconds_to_end(1, killed_at) < 60
    rerun = start_job(cluster, run_dir, "rerun")
    assert rerun.wait(120) == [0, 0], rerun.log_text()
    assert total(run_dir) == EXPECTED_TOTAL


@pytest.mark.extended  # a crash mid checkpoint write, against the real launcher: test_faults.py, in CI's tier
def test_crash_in_the_middle_of_a_checkpoint_write(cluster, tmp_path):
    run_dir = tmp_path / "run"
    attempt = start_job(cluster, run_dir, "first", ckpt_every=5)
    progress.wait_until(
        lambda: len(progress.committed_checkpoints(run_dir)) >= 1, 60, "a first checkpoint", attempt.dead_reason
    )
    crash = crash_during_checkpoint_write(cluster, cluster.nodes[0], run_dir, timeout_s=60)
    assert crash.caught.step > progress.committed_checkpoints(run_dir)[-1]
    assert 0 < crash.caught.files["state.pt"] < 8 * 256 * 1024, crash.caught.describe()
    assert attempt.wait(60)[1] != 0
    rerun = start_job(cluster, run_dir, "rerun", ckpt_every=5)
    assert rerun.wait(120) == [0, 0], rerun.log_text()
    assert total(run_dir) == EXPECTED_TOTAL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
