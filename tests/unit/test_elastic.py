"""Elastic node ranges (launch.elastic): the torchrun argv (golden file), the one check of MIN:MAX, and the
run-dir lock of an elastic job, whose launchers join one another (real processes holding real flocks)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO as ROOT
from tests.unit.test_local_launcher import check_golden
from torchlaunch import runlock
from torchlaunch.agent.commands import NodePlacement, runs_without_agent, torchrun_argv
from torchlaunch.backends.slurm.sbatch import sbatch_nodes
from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import elastic, shape
from torchlaunch.launch.spec import JobSpec

JOB = elastic.job_key("tl-x", "node0", 29500)


def test_elastic_argv_golden() -> None:
    spec = JobSpec(config="runs/golden/config.yaml", nodes=4, min_nodes=2, gpus_per_node=8, max_restarts=3)
    placement = NodePlacement(master_addr="node0", rdzv_conf=elastic.parse_rdzv_conf("last_call_timeout=10"))
    check_golden("local_argv_elastic.txt", torchrun_argv(spec, placement, python="python", rdzv_run_id="tl-golden"))


def test_elastic_argv_has_no_node_rank_and_no_host_flag() -> None:
    spec = JobSpec(config="c.yaml", nodes=2, min_nodes=1, max_restarts=1)
    argv = torchrun_argv(spec, NodePlacement(master_addr="127.0.0.1"), rdzv_run_id="x")
    assert argv[argv.index("--nnodes") + 1] == "1:2"
    assert "--node-rank" not in argv and "--standalone" not in argv and "--rdzv-conf" not in argv
    assert not runs_without_agent(JobSpec(config="c.yaml", nodes=1, min_nodes=1), NodePlacement(master_addr="h"))


@pytest.mark.parametrize(
    ("text", "want"),
    [("3", (3, 3)), ("1:2", (1, 2)), ("1-4", (1, 4)), (" 2 : 2 ", (2, 2)), (5, (5, 5))],
)
def test_node_ranges(text: str | int, want: tuple[int, int]) -> None:
    nodes = shape.parse_nodes("--nnodes", text)
    assert (nodes.min, nodes.max) == want
    assert nodes.elastic == (want[0] != want[1])
    assert sbatch_nodes(nodes) == (f"{want[0]}-{want[1]}" if nodes.elastic else str(want[1]))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0:2", "--nnodes must be >= 1, got 0"),
        ("2:1", "MIN 2 is more than MAX 1"),
        ("1:100001", "--nnodes must be at most 100000"),
        ("a:b", "pass a node count N or a range MIN:MAX"),
        ("1:2:3", "pass a node count N or a range MIN:MAX"),
        ("", "pass a node count N or a range MIN:MAX"),
    ],
)
def test_bad_node_ranges_are_one_line(text: str, needle: str) -> None:
    with pytest.raises(BadInput) as caught:
        shape.parse_nodes("--nnodes", text)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("is_host=1", "not a rendezvous setting"),
        ("last_call_timeout=0", "must be a whole number 1..86400"),
        ("last_call_timeout", "must be a whole number"),
        ("join_timeout=1e3", "must be a whole number"),
    ],
)
def test_bad_rdzv_conf_is_one_line(text: str, needle: str) -> None:
    with pytest.raises(BadInput) as caught:
        elastic.parse_rdzv_conf(text)
    assert needle in str(caught.value)


MEMBER = textwrap.dedent(
    """
    import sys
    from torchlaunch import runlock
    lock = runlock.acquire(sys.argv[1], command=["member"], job=sys.argv[2])
    print("slot", lock.slot, flush=True)
    sys.stdin.readline()
    """
)


def member(run_dir: Path, job: str = JOB) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", MEMBER, str(run_dir), job],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline().split()  # type: ignore[union-attr]
    assert line[:1] == ["slot"], proc.stderr.read()  # type: ignore[union-attr]
    return proc, int(line[1])


def test_an_elastic_job_is_refused_on_a_run_dir_another_launch_holds(tmp_path: Path) -> None:
    lock = runlock.acquire(tmp_path, command=["plain"])
    try:
        with pytest.raises(BadInput, match="is in use by pid"):
            runlock.acquire(tmp_path, job=JOB)
    finally:
        lock.release()


def test_elastic_sbatch_golden() -> None:
    """--nodes 1-2: one #SBATCH --nodes=1-2 (submitit's own count stays 2) and --requeue, so Slurm requeues
    the job after a node failure onto the nodes that are up; srun lays out the tasks (launch.elastic)."""
    from torchlaunch.backends.slurm.render import SlurmOptions, executor_parameters, sbatch_script

    spec = JobSpec(config="configs/smoke.yaml", nodes=2, min_nodes=1, gpus_per_node=2, run_dir="/shared/runs/e")
    options = SlurmOptions(use_gpus=False, python="/opt/venv/bin/python", repo_root="/opt/repo")
    script = sbatch_script(spec, options)
    path = Path(__file__).resolve().parents[1] / "golden" / "slurm_elastic.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(script)
    assert script == path.read_text()
    assert script.count("#SBATCH --nodes=") == 1 and "#SBATCH --nodes=1-2\n" in script
    assert "#SBATCH --requeue\n" in script
    params = executor_parameters(spec, options, "/shared/runs/e")
    assert params["nodes"] == 2 and "ntasks_per_node" not in params and "#SBATCH --ntasks-per-node" not in script
    assert " --ntasks-per-node 2 /opt/venv/bin/python " in script and "#SBATCH --mincpus=2\n" in script


@pytest.mark.parametrize(
    ("nodes", "needle"),
    [
        ("2-1", "MIN 2 is more than MAX 1 (e.g. --nodes 1-2)"),  # the example in the user's own spelling
        ("2:1", "MIN 2 is more than MAX 1 (e.g. --nodes 1:2)"),
        ("2-1\n", "--nodes '2-1': MIN 2"),  # a trailing newline neither splits the line nor is echoed
        ("0-2", "--nodes must be >= 1, got 0"),
        ("1..2", "a range MIN:MAX"),
    ],
)
def test_slurm_bad_node_ranges_are_one_line(nodes: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from torchlaunch.backends.slurm import launch as slurm

    code = slurm.main(["--dry-run", "--nodes", nodes, "--tasks-per-node", "1", "--config", "configs/smoke.yaml"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_wait_follows_a_job_requeued_after_a_node_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a node failure sacct's last record is the failed allocation's NODE_FAIL while slurmctld has
    requeued the job (PENDING), and for a moment both say NODE_FAIL: --wait goes on until the requeued
    allocation ends."""
    from torchlaunch.backends.slurm import follow as slurm

    class Job:
        job_id = "8"
        paths = type("Paths", (), {"folder": str(tmp_path)})()

    said = iter(
        [("NODE_FAIL", "NODE_FAIL"), ("NODE_FAIL", "PENDING"), ("NODE_FAIL", "RUNNING"), ("COMPLETED", "COMPLETED")]
    )
    now: list[tuple[str, str]] = []

    def sacct(job_id: str) -> str:
        now[:] = [next(said)]
        return now[0][0]

    monkeypatch.setattr(slurm, "STATE_SOURCES", (sacct, lambda job_id: now[0][1]))
    assert slurm.follow(Job(), poll_s=0, out=io.StringIO(), err=io.StringIO()) == 0
    assert next(said, None) is None  # it polled through the requeue to the end


def test_torchrun_gets_the_join_timeout_with_the_last_call_on_top() -> None:
    """Issue 52: torchrun's join_timeout covers the last call after MIN nodes, so join_timeout=5 with
    last_call_timeout=10 timed out every node though MIN had arrived; ours bounds the wait for MIN."""
    conf = elastic.parse_rdzv_conf("join_timeout=5,last_call_timeout=10", elastic.DEFAULT_RDZV)
    argv = elastic.torchrun_rendezvous(shape.NodeRange(1, 2), "127.0.0.1", 29500, "r", conf)
    said = dict(item.split("=") for item in argv[argv.index("--rdzv-conf") + 1].split(","))
    assert said["join_timeout"] == "15" and said["last_call_timeout"] == "10"
    argv = elastic.torchrun_rendezvous(shape.NodeRange(1, 2), "h", 1, "r", (("join_timeout", 5),))
    assert argv[-1] == "join_timeout=35"  # torchrun's own 30 s last call
    argv = elastic.torchrun_rendezvous(shape.NodeRange(1, 2), "h", 1, "r", (("last_call_timeout", 3),))
    assert argv[-1] == "last_call_timeout=3"
