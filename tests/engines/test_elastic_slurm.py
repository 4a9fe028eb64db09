"""Degraded restart on Slurm (slurm/dev-cluster.sh, two slurmd nodes): `launch.slurm --nodes 1-2` starts
on both nodes; one node is set DOWN mid-run (and kept out with DRAIN: the dev cluster's ReturnToService=2
would otherwise take it back at its next registration); Slurm ends the allocation (NODE_FAIL) and requeues
the job (--requeue), which starts again on the one node that is up, resumes from the last committed
checkpoint on world size 1 and finishes. Every global step drew the samples of an uninterrupted run.

The node is set RESUME again whatever happens. While it is DOWN, other jobs of the shared dev cluster
cannot use it: the window is bounded by the test's deadlines."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.engines.test_slurm_cluster import Launch, requeue_records, slurm, wait_until
from tests.engines.test_slurm_cluster import cluster as dev_cluster  # the module fixture, shared
from tests.integration.test_elastic_local import RECIPE, check_same_samples, records, samples
from tests.library import RunLibrary

cluster = dev_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LOST = "n2"


def traced(run_dir: Path) -> tuple[int, set[int]]:
    found = records(run_dir)
    return max((r["step"] for r in found), default=0), {r["world_size"] for r in found}


def allocations(job_id: str) -> list[tuple[str, str]]:
    """(state, node count) of every allocation of the job, oldest first, as slurmdbd has recorded them.

    slurmdbd learns of a start or an end asynchronously: a record read right after the event may still
    show the previous state (a running allocation read as pending with 0 nodes). Live questions go to
    squeue (`running_nodes`); this one is read once the records have settled (`settled_allocations`)."""
    out = slurm("sacct", "-n", "-X", "-D", "-P", "-o", "State,NNodes", "-j", job_id)
    return [tuple(line.split("|")) for line in out.splitlines() if line]  # type: ignore[misc]


def running_nodes(job_id: str) -> int:
    """Nodes of the job's running allocation, from slurmctld itself (0 when it is not running)."""
    out = slurm("squeue", "-h", "-t", "RUNNING", "-o", "%D", "-j", job_id).strip()
    return int(out) if out else 0


def settled_allocations(job_id: str, timeout: float = 60) -> list[tuple[str, str]]:
    """The allocations once slurmdbd has recorded the job's end (its last record no longer running)."""

    def settled() -> list[tuple[str, str]]:
        found = allocations(job_id)
        return found if found and found[-1][0] not in ("PENDING", "RUNNING", "REQUEUED") else []

    return wait_until(settled, timeout, "slurmdbd to record the job's end")


@pytest.mark.timeout(600)
def test_node_down_requeues_onto_the_node_left_with_the_same_samples(
    cluster: str, tmp_path: Path, run_library: RunLibrary
) -> None:
    # The uninterrupted local run of RECIPE: the session's library entry "elastic", built on this first
    # ask once the cluster is up (its exit code asserted there, tests/library.py), read only.
    reference_dir = run_library.path("elastic")
    reference: dict[int, list] = {}
    for rec in records(reference_dir):
        reference.setdefault(rec["step"], []).extend(samples(rec))
    reference = {k: sorted(v) for k, v in reference.items()}

    run_dir = tmp_path / "run"
    restart = "recovery.live=false"  # the subject: the requeue road (the live one: test_live_slurm.py)
    launch = Launch(run_dir, "--nodes", "1-2", "--tasks-per-node", "1", "--time", "10", *RECIPE, restart)
    try:
        wait_until(lambda: traced(run_dir)[0] >= 8 and 2 in traced(run_dir)[1], 180, "training on 2 nodes")
        assert running_nodes(launch.job_id) == 2
        slurm("scontrol", "update", f"nodename={LOST}", "state=down", "reason=torchlaunch elastic test")
        slurm("scontrol", "update", f"nodename={LOST}", "state=drain", "reason=torchlaunch elastic test")
        wait_until(lambda: "NODE_FAIL" in requeue_records(launch.job_id), 60, "the node failure")
        code = launch.finish(300)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={LOST}", "state=resume"], capture_output=True, timeout=30)
    assert code == 0, launch.text()[-3000:]
    states = settled_allocations(launch.job_id)
    assert states[0] == ("NODE_FAIL", "2") and states[-1] == ("COMPLETED", "1"), states
    log = launch.rank0_log()
    assert "resumed from" in log, log[-3000:]
    assert check_same_samples(reference, records(run_dir)) == {1, 2}
    assert json.loads((run_dir / "trace" / "rank0.jsonl").read_text().splitlines()[-1])["world_size"] == 1
