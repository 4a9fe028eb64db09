"""Live recovery on Slurm (slurm/dev-cluster.sh, two slurmd nodes on this host): `launch.slurm --nodes 2
--tasks-per-node 1`, the default command line: no recovery key, live by default, the job's nodes
place the membership service through the run dir's lease (one test names a service started here, the way
out that stays). Once node n2's rank has traced step KILL_AT, every process
of the job on n2 is SIGKILLed (found by SLURM_JOB_ID and SLURMD_NODENAME in /proc/PID/environ) and n2
is set DOWN, as slurmctld marks a node that stopped answering: with sbatch and srun --no-kill the job
keeps n1, whose rank regroups in place and trains every step to the end in the same process.

Asserted: `--wait` exits 0 and Slurm says COMPLETED, not NODE_FAIL (the batch script's verdict: srun's 137 for the
lost task is not the job's); every global step's samples, crops and flips are those of an
uninterrupted run (bench/live.py's recipe under launch.local, 2 ranks); one regroup, to 1 rank; no
`resumed from`; `status` shows the run finished on 1 rank with rank 1 gone. n2 is set RESUME again
whatever happens. Both nodes share this host, so every store address is loopback.

The same with `--nodes 1-2`: Slurm allocates both nodes, the group shrinks to n1's rank and finishes
(one node is the range's minimum). With `--nodes 2-3` (both of the cluster's nodes are allocated) the
same loss leaves 1 node, below the minimum 2: the rank left commits a checkpoint at the last whole step
and exits 75, rank 0 requeues the job once, and once n2 is back the requeued allocation resumes from
that checkpoint on 2 ranks; every global step's samples, crops and flips are the uninterrupted run's
and so are the final weights, bit for bit (no step trained on 1 rank). The requeue is read from
slurmctld (Restarts=1): slurmdbd 22.05 folds the requeued allocation into the record the node's removal
opened (RESIZING, then COMPLETED), so `sacct -D` keeps no REQUEUED line for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import live
from tests.conftest import launcher_argv, lighthouse_serving, run_cmd
from tests.engines.test_elastic_slurm import running_nodes
from tests.engines.test_slurm_cluster import Launch, requeue_records, slurm, wait_until
from tests.engines.test_slurm_cluster import cluster as dev_cluster  # the module fixture, shared
from tests.helpers import assert_models_equal
from tests.integration.test_live_recovery import step_samples
from tests.library import RunLibrary
from torchlaunch.backends.slurm import live as slurm_live
from torchlaunch.backends.slurm import successor
from torchlaunch.exit_codes import CANCELLED
from torchlaunch.live import placement

cluster = dev_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LOST = "n2"


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[str]:
    """`python -m launch.lighthouse` on loopback, apart from the job."""
    with lighthouse_serving(tmp_path / "lighthouse.log") as address:
        yield address


@pytest.fixture
def reference(run_library: RunLibrary) -> live.LiveRun:
    """The uninterrupted run (launch.local, 2 ranks, nothing killed): the plan does not depend on the world."""
    built = run_library.get("live")  # read only
    return live.LiveRun(built.path, built.result.returncode, built.result.stderr, killed_at=None)


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


def launch_live(tmp_path: Path, nodes: str, lighthouse: str = "") -> tuple[Path, Launch]:
    """The live recipe (bench/live.py's) submitted on `--nodes nodes` x 1 task: by default as a user
    writes it, with no recovery.lighthouse (the job's nodes place the service through the run dir);
    else with the service given (started here)."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "live.yaml"
    if lighthouse:  # the way out: recovery.live=true with a service named
        recipe.write_text(live.config_text(run_dir) + f"  lighthouse: {lighthouse}\n")
    else:  # no recovery key at all: live by default
        recipe.write_text(live.config_text(run_dir, live=None))
    return run_dir, Launch(run_dir, "--nodes", nodes, "--tasks-per-node", "1", "--time", "10", "--config", str(recipe))


def lose_n2(run_dir: Path, launch: Launch) -> int:
    """Once rank 1 (on n2) traced step KILL_AT: every process of the job on n2 SIGKILLed, n2 set DOWN.
    Rank 0's PID before the loss."""
    wait_until(
        lambda: live.traced_step(run_dir / "trace" / "rank1.jsonl") >= live.KILL_AT or launch.proc.poll() is not None,
        240,
        f"rank 1 to trace step {live.KILL_AT}",
        poll_s=0.02,
    )
    assert launch.proc.poll() is None, launch.text()[-3000:]
    assert running_nodes(launch.job_id) == 2  # a range too: Slurm allocated both nodes
    survivor = live.pid_of(run_dir, 0)
    assert kill_node(launch.job_id, LOST)
    slurm("scontrol", "update", f"nodename={LOST}", "state=down", "reason=torchlaunch live test")
    return survivor


def resume_n2() -> None:
    subprocess.run(["scontrol", "update", f"nodename={LOST}", "state=resume"], capture_output=True, timeout=30)


def controller(job_id: str) -> dict[str, str]:
    """slurmctld's fields of the job (`scontrol show job -o`): it keeps a job for MinJobAge after its end."""
    fields = slurm("scontrol", "show", "job", "-o", job_id).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def status_of(run_dir: Path) -> dict:
    rc, shown, err = run_cmd(launcher_argv("launch", "status", str(run_dir), "--json"), timeout=60)
    assert rc == 0, err
    return json.loads(shown)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "nodes",
    [
        "2",
        # the range's node loss with nothing below its minimum: CI proves it on launch.local (test_live_range_two_nodes.py,
        # 1:2, node 1 lost) and a range on Slurm through the batch host's loss and the whole-job preemption
        pytest.param("1-2", marks=pytest.mark.extended),
    ],
)
def test_a_lost_node_costs_a_regroup_and_the_job_completes(
    cluster: str, reference: live.LiveRun, tmp_path: Path, nodes: str
) -> None:
    """The default command line: no recovery.lighthouse, nothing started by hand. n1 (node 0) places the
    service; losing n2 costs a regroup in place."""
    run_dir, launch = launch_live(tmp_path, nodes)
    try:
        survivor = lose_n2(run_dir, launch)
        code = launch.finish(300)
    finally:
        resume_n2()
    out = launch.text()
    assert code == 0, out[-3000:]
    # slurmdbd records the allocation that lost n2 as RESIZING (the node was removed from the job), then
    # the job's end: COMPLETED, never NODE_FAIL (what the job gets without --no-kill) nor a requeue.
    allocations = requeue_records(launch.job_id)
    assert allocations[-1] == "COMPLETED" and set(allocations) <= {"RESIZING", "COMPLETED"}, allocations
    assert "task(s) 1 lost (no outcome recorded, or left out of the group that trained); the others finished" in out, (
        out[-3000:]
    )
    assert slurm_live.road_line(True) in out, out[-3000:]
    # n1 placed the service (the first lease) and kept it: no takeover was needed, none happened
    assert placement.newest(placement.folder_of(run_dir)) == 1, sorted(os.listdir(placement.folder_of(run_dir)))
    assert "resumed from" not in out, "the job was restarted"
    assert live.pid_of(run_dir, 0) == survivor, "the survivor's process changed"
    events = [
        json.loads(line) for line in (run_dir / "live" / "events-rank0.jsonl").read_text().splitlines() if line.strip()
    ]
    regrouped = [(e["world"], e["rank"]) for e in events if e["event"] == "regrouped"]
    assert regrouped == [(1, 0)], events
    assert step_samples(run_dir) == step_samples(reference.run_dir)
    st = status_of(run_dir)
    assert (st["state"], st["step"], st["world_size"]) == ("finished", live.STEPS, 1), st
    assert {r["rank"] for r in st["ranks"] if r["gone"]} == {1}, st["ranks"]


def freeze_node(job_id: str, node: str) -> list[int]:
    """SIGSTOP every process of the job on `node` until every one is stopped (a hung node: its task, its
    live agent's thread, the membership service standby, the echo process, the loader workers)."""
    stopped: list[int] = []

    def state(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "gone"

    def all_stopped() -> bool:
        pids = job_pids(job_id, node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        return bool(pids) and all(state(pid) in ("T", "gone") for pid in pids)

    wait_until(all_stopped, 30, f"the job's processes on {node} to be stopped", poll_s=0.02)
    return sorted(set(stopped))


def regrouped(run_dir: Path, rank: int = 0) -> list[dict]:
    path = run_dir / "live" / f"events-rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(str.strip, lines)) if e["event"] == "regrouped"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "woken",
    [
        False,
        # the woken node is fenced by the run dir's generation: proven in CI on Docker pods (the paused
        # pod's rank), and here as the bug's reproduction (it retrained the finished run's tail over it)
        pytest.param(True, marks=pytest.mark.extended),
    ],
    ids=["down", "woken"],
)
def test_a_whole_node_frozen_past_the_bound_costs_a_regroup_and_the_job_completes(
    cluster: str, reference: live.LiveRun, tmp_path: Path, woken: bool
) -> None:
    """The default command line (`--nodes 2`, no recovery key). Once n2's rank traced step KILL_AT, every
    process of the job on n2 is SIGSTOPped at once, as a hung node: no transport error comes, its agent
    (a thread of the task) is stopped too, so nothing on n2 fences its rank. n1's rank judges it silent
    past recovery.heartbeat_timeout_s (its echo gives no answer) and regroups in its own process.
    `down`: n2 is then set DOWN, as slurmctld does to a node that stopped answering; its slurmd ends the
    stopped step, and the job COMPLETES on n1. `woken`: n2's processes are SIGCONTinued after the
    regroup (a hang shorter than SlurmdTimeout): its rank's group is gone, and the group it forms alone
    (it serves a lease of its own once n1 is done) comes from a superseded generation: fenced, it leaves
    without writing (before the fix it retrained the finished run's tail and saved model.pt over it); its
    task records that it was left out, so the batch script's verdict counts it as lost, not as the job's
    bad input (before: the job and `status` said bad input, though the run finished on n1).
    Both: every global step's samples, crops and flips are the uninterrupted run's; one regroup, to 1."""
    run_dir, launch = launch_live(tmp_path, "2")
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
        frozen = freeze_node(launch.job_id, LOST)
        wait_until(lambda: regrouped(run_dir) or launch.proc.poll() is not None, 120, "n1's rank to regroup")
        assert all(Path(f"/proc/{pid}").exists() for pid in frozen), "a frozen process ended: not a freeze"
        if woken:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        else:
            slurm("scontrol", "update", f"nodename={LOST}", "state=down", "reason=torchlaunch live test")
        code = launch.finish(300)
    finally:
        if launch.proc.poll() is None:  # failed on the way: no stopped process of the job is left behind
            launch.proc.kill()
            subprocess.run(["scancel", launch.job_id], capture_output=True, timeout=30)  # as Launch.finish does
        resume_n2()
    out, log = launch.text(), launch.rank0_log()
    said = (run_dir / "slurm" / launch.job_id / f"{launch.job_id}_0_log.err").read_text()
    assert "taken for silent (frozen or cut off)" in said, said[-3000:]
    assert [(e["world"], e["rank"]) for e in regrouped(run_dir)] == [(1, 0)], regrouped(run_dir)
    assert live.pid_of(run_dir, 0) == survivor, "the survivor's process changed"
    assert "resumed from" not in out + log, "the job was restarted"
    assert step_samples(run_dir) == step_samples(reference.run_dir)
    assert (run_dir / "live" / "generation").read_text().strip() == "2", "a group formed past the survivor's"
    frozen_side = trace_records(run_dir)["rank1.jsonl"]  # it never traced a step in a group of its own
    assert {(r["generation"], r["world_size"]) for r in frozen_side} == {(1, 2)}, frozen_side[-2:]
    st = status_of(run_dir)
    assert st["step"] == live.STEPS and st["checkpoint"]["step"] == live.STEPS, st
    if woken:  # fenced: its task leaves with exit 2 and records that it was left out
        task1 = (run_dir / "slurm" / launch.job_id / f"{launch.job_id}_1_log.err").read_text()
        assert "but generation 2 trains" in task1 and "left out, this rank leaves without writing" in task1, task1
    assert code == 0, out[-3000:]
    assert "task(s) 1 lost (no outcome recorded, or left out of the group that trained); the others finished" in out
    if woken:
        assert st["state"] == "finished", st
        return
    allocations = requeue_records(launch.job_id)
    assert allocations[-1] == "COMPLETED" and set(allocations) <= {"RESIZING", "COMPLETED"}, allocations
    assert (st["state"], st["world_size"], {r["rank"] for r in st["ranks"] if r["gone"]}) == ("finished", 1, {1}), st


@pytest.mark.timeout(600)
def test_a_loss_below_the_node_ranges_minimum_checkpoints_requeues_and_resumes_exactly(
    cluster: str, reference: live.LiveRun, tmp_path: Path
) -> None:
    run_dir, launch = launch_live(tmp_path, "2-3")
    try:
        survivor = lose_n2(run_dir, launch)
        stopped = wait_until(
            lambda: (
                re.search(
                    r"live: 1 node left, below --nodes 2-3's minimum of 2 nodes: checkpoint committed at "
                    r"global step (\d+); exit 75",
                    launch.rank0_log(),
                )
                or launch.proc.poll() is not None
            ),
            120,
            "the rank left to stop below the minimum",
        )
        assert launch.proc.poll() is None, launch.text()[-3000:]
        wait_until(lambda: controller(launch.job_id).get("Restarts") == "1", 60, "the requeue")
    finally:
        resume_n2()  # the requeued allocation needs 2 nodes again
    code = launch.finish(300)
    out, log = launch.text(), launch.rank0_log()
    assert code == 0, out[-3000:]
    step = int(stopped.group(1))
    assert live.KILL_AT - 1 <= step < live.STEPS, log[-3000:]  # the kill lands a few steps after KILL_AT
    assert f"slurm task: below the live minimum: checkpoint committed, job {launch.job_id} requeued" in log, log[-3000:]
    assert f"(global step {step})" in log.split("live: 1 node left")[1], "not resumed from the checkpoint it stopped at"
    # Requeued once, the new allocation on both nodes. slurmctld's word: slurmdbd (22.05) merges the
    # requeued allocation into the record the resize opened (RESIZING, then COMPLETED on "1 node").
    job = controller(launch.job_id)
    assert (job["JobState"], job["Restarts"], job["NumNodes"]) == ("COMPLETED", "1", "2"), job
    assert requeue_records(launch.job_id)[-1] == "COMPLETED"
    assert log.count("slurm task: rank 0/2 ") == 2, "one requeue: two allocations of 2 tasks"
    assert live.pid_of(run_dir, 0) != survivor, "the requeued allocation runs new processes"
    events = [
        json.loads(line) for line in (run_dir / "live" / "events-rank0.jsonl").read_text().splitlines() if line.strip()
    ]
    assert [(e["event"], e["world"]) for e in events if e["event"] in ("regrouped", "below_minimum")] == [
        ("regrouped", 1),
        ("below_minimum", 1),
    ], events
    assert step_samples(run_dir) == step_samples(reference.run_dir)
    assert_models_equal(run_dir / "model.pt", reference.run_dir / "model.pt")
    st = status_of(run_dir)
    assert (st["state"], st["step"], st["world_size"]) == ("finished", live.STEPS, 2), st
    assert not any(r["gone"] for r in st["ranks"]), st["ranks"]
    assert [(r["world_size"], r["stopped"]) for r in st["regroups"]] == [(1, True)], st["regroups"]


@pytest.mark.timeout(600)
def test_a_whole_job_preempted_from_outside_checkpoints_requeues_and_resumes_exactly(
    cluster: str, reference: live.LiveRun, tmp_path: Path
) -> None:
    """A preemption of the whole job is not a node loss: `scancel --signal=USR2 --full` reaches every
    process of the job (both tasks, the batch shell); the ranks agree on a step, commit it, exit 75, the
    job is requeued once and resumes on both nodes from that step: nothing regroups, every step exact."""
    run_dir, launch = launch_live(tmp_path, "1-2")
    wait_until(
        lambda: live.traced_step(run_dir / "trace" / "rank1.jsonl") >= live.KILL_AT or launch.proc.poll() is not None,
        240,
        f"rank 1 to trace step {live.KILL_AT}",
        poll_s=0.02,
    )
    assert launch.proc.poll() is None, launch.text()[-3000:]
    slurm("scancel", "--signal=USR2", "--full", launch.job_id)
    wait_until(lambda: controller(launch.job_id).get("Restarts") == "1", 120, "the requeue")
    code = launch.finish(300)
    out, log = launch.text(), launch.rank0_log()
    assert code == 0, out[-3000:]
    assert "resumed from" in log, log[-3000:]
    job = controller(launch.job_id)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), job
    assert log.count("slurm task: rank 0/2 ") == 2, "one requeue: two allocations of 2 tasks"
    assert not (run_dir / "live" / "events-rank0.jsonl").exists(), "a live event: the stop was taken for a loss"
    assert step_samples(run_dir) == step_samples(reference.run_dir)
    assert_models_equal(run_dir / "model.pt", reference.run_dir / "model.pt")
    st = status_of(run_dir)
    assert (st["state"], st["step"], st["world_size"]) == ("finished", live.STEPS, 2), st


BATCH_HOST = "n1"


def set_node(node: str, *states: str) -> None:
    for state in states:
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", f"state={state}", "reason=torchlaunch live test"],
            capture_output=True,
            timeout=30,
        )


def node_back(node: str) -> None:
    """The node RESUMEd and idle again (the next test's allocation may need it)."""
    set_node(node, "resume")
    wait_until(lambda: slurm("sinfo", "-h", "-n", node, "-o", "%T").strip() == "idle", 60, f"{node} idle again")


def trace_records(run_dir: Path) -> dict[str, list[dict]]:
    """Each rank's batch trace records so far, by file name (a line being written, or cut short by a
    SIGKILL, is left out)."""
    return {
        path.name: [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
        for path in sorted((run_dir / "trace").glob("rank*.jsonl"))
    }


def successor_stepped(run_dir: Path, lost: dict[str, list[dict]]) -> bool:
    """Whether a rank of the successor traced its first step: a file grew past, or no longer starts with,
    what the lost job left (a resumed rank first cuts its file back to the checkpoint's step)."""
    for name, records in trace_records(run_dir).items():
        before = lost.get(name, [])
        if len(records) > len(before) or records != before[: len(records)]:
            return True
    return False


def samples_across_jobs(
    run_dir: Path, lost: dict[str, list[dict]], resumed_at: int
) -> dict[int, dict[int, tuple[int, int, bool]]]:
    """step_samples for a run that another job took over at global step `resumed_at`, given each rank's
    trace records when the lost job was over (`lost`). A rank of the successor cuts its file back to the
    checkpoint's step and appends its own steps (worker/metrics.MetricsLog); a file it did not open keeps
    the lost job's lines, among them the rank left's attempts of steps past the checkpoint, which the
    successor trained again. So a step the successor traced is its own, and every other step is the lost
    job's, from its last group (step_samples' rule). A sample traced twice within one attempt fails."""
    old: list[dict] = []
    new: list[dict] = []
    for name, records in trace_records(run_dir).items():
        before = lost.get(name, [])
        if records[: len(before)] == before and len(records) == len(before):
            old += records  # the successor did not write this rank's file
            continue
        kept = next((i for i, r in enumerate(records) if r["step"] > resumed_at), len(records))
        old += records[:kept]
        new += records[kept:]
    redone = {r["step"] for r in new}
    last: dict[int, int] = {}
    for r in old:
        last[r["step"]] = max(last.get(r["step"], 0), r.get("generation", 0))
    kept_old = [r for r in old if r["step"] not in redone and r.get("generation", 0) == last[r["step"]]]
    steps: dict[int, dict[int, tuple[int, int, bool]]] = {}
    for r in [*kept_old, *new]:
        samples = steps.setdefault(r["step"], {})
        for i, index in enumerate(r["indices"]):
            assert index not in samples, f"step {r['step']}: sample {index} trained twice"
            samples[index] = (r["dy"][i], r["dx"][i], r["flip"][i])
    return steps


def over(job_id: str) -> bool:
    """slurmctld is done with the job on every node (no longer RUNNING or COMPLETING)."""
    from torchlaunch.backends.slurm.cluster import controller_state
    from torchlaunch.backends.slurm.states import TERMINAL_STATES

    return controller_state(job_id) in ("UNKNOWN", *TERMINAL_STATES)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "nodes", ["1-2", pytest.param("2", marks=pytest.mark.extended)]
)  # the same successor; with a fixed count it waits for the node back: the extended tier's
def test_the_batch_hosts_loss_starts_a_successor_that_resumes_the_run(
    cluster: str, reference: live.LiveRun, tmp_path: Path, nodes: str
) -> None:
    """Issue #37's "any node" on Slurm: the first node (the batch host, rank 0) of a live job lost whole at
    step ~12 (every process of the job on n1 SIGKILLed, n1 DOWN and DRAINed so that it stays out). The job
    ends FAILED (its batch script died; --no-kill does not requeue it), and the successor its batch script
    submitted at start (afternotok) takes the run over: with `--nodes 1-2` at once on n2 alone; with a fixed
    `--nodes 2` it waits (`status` says pending and names it) until n1 is back, then runs on both. It
    resumes from the newest committed checkpoint and finishes; `--wait` follows it and exits 0. Every
    global step's samples, crops and flips are the uninterrupted run's."""

    run_dir = tmp_path / "run"
    recipe = tmp_path / "live.yaml"
    # Checkpoints every 4 steps: what the successor resumes from when the rank left could not commit its own.
    # No recovery.lighthouse: the service on n1 is lost with it; the successor's nodes take the next lease.
    recipe.write_text(live.config_text(run_dir, live=None, every_steps=4))
    launch = Launch(run_dir, "--nodes", nodes, "--tasks-per-node", "1", "--time", "10", "--config", str(recipe))
    first = launch.job_id
    rank0 = run_dir / "trace" / "rank0.jsonl"
    waited = None
    try:
        wait_until(lambda: live.traced_step(rank0) >= 1 or launch.proc.poll() is not None, 240, "the first step")
        assert launch.proc.poll() is None, launch.text()[-3000:]
        assert running_nodes(first) == 2
        assert controller(first)["BatchHost"] == BATCH_HOST
        after = successor.read(run_dir, first)  # written by the batch script before its srun
        assert after is not None and after.successor is not None, launch.rank0_log()[-3000:]
        second = after.successor
        assert controller(second)["JobState"] == "PENDING"
        wait_until(
            lambda: live.traced_step(rank0) >= live.KILL_AT or launch.proc.poll() is not None,
            240,
            f"rank 0 to trace step {live.KILL_AT}",
            poll_s=0.02,
        )
        assert launch.proc.poll() is None, launch.text()[-3000:]
        killed_at = time.time()
        assert kill_node(first, BATCH_HOST)
        set_node(BATCH_HOST, "down", "drain")  # DRAIN: ReturnToService=2 would take it back at once
        wait_until(lambda: over(first), 120, f"job {first} to end on every node", poll_s=0.05)
        ended_s = time.time() - killed_at
        lost = trace_records(run_dir)  # the job is over: a trace line from here on is the successor's
        before = [r["step"] for records in lost.values() for r in records]
        if nodes == "2":  # the successor needs both nodes: it waits for n1, and status says so
            waited = wait_until(lambda: (st := status_of(run_dir))["state"] == "pending" and st, 60, "pending")
            assert controller(second)["JobState"] == "PENDING"
            node_back(BATCH_HOST)
        wait_until(
            lambda: successor_stepped(run_dir, lost) or launch.proc.poll() is not None,
            300,
            "the successor's first step",
            poll_s=0.05,
        )
        first_step_s = time.time() - killed_at
        code = launch.finish(300)
    finally:
        node_back(BATCH_HOST)
    out = launch.text()
    assert code == 0, out[-3000:]
    job = controller(first)
    assert job["JobState"] in successor.LOST_STATES and job["Restarts"] == "0", job
    assert f"launch: job {first} lost its batch host ({job['JobState']}); following its successor job {second}" in out
    took = controller(second)
    assert (took["JobState"], took["NodeList"]) == ("COMPLETED", "n2" if nodes == "1-2" else "n[1-2]"), took
    if waited is not None:
        assert f"its successor job {second} is PENDING" in waited["reason"], waited
    log = (run_dir / "slurm" / second / f"{second}_0_log.out").read_text()
    assert f"slurm successor: job {first} was lost" in log, log[-3000:]
    resumed = re.search(r"resumed from \S+ at .* \(global step (\d+)\)", log)
    assert resumed is not None, log[-3000:]
    step = int(resumed.group(1))
    assert 8 <= step <= max(before), log[-3000:]  # a periodic checkpoint at least, or the loss's own step
    mine = successor.read(run_dir, second)
    assert mine is not None and mine.adopted and mine.code == 0, mine
    if mine.successor is not None:  # the successor's own successor: cancelled when it completed
        assert controller(mine.successor)["JobState"] == "CANCELLED"
    assert samples_across_jobs(run_dir, lost, step) == step_samples(reference.run_dir)
    st = status_of(run_dir)
    assert (st["state"], st["step"], st["job_id"]) == ("finished", live.STEPS, second), st
    leases = placement.folder_of(run_dir)
    assert placement.newest(leases) >= 2, sorted(os.listdir(leases))  # the successor's, after the lost job's
    survivor = (run_dir / "slurm" / first / f"{first}_1_log.out").read_text()
    committed = re.search(r"preempted: checkpoint committed at global step (\d+)", survivor)
    print(
        f"\nbatch host lost at step {max(before)}: job {first} {job['JobState']}, over on every node "
        f"{ended_s:.1f} s after the kill; the rank left "
        f"{'committed step ' + committed.group(1) if committed else 'committed nothing'}; successor job {second} "
        f"resumed from step {step}; kill -> the successor's first step {first_step_s:.1f} s"
        + (" (n1 resumed by the test meanwhile)" if waited is not None else "")
    )


@pytest.mark.timeout(600)
def test_a_users_cancel_cancels_the_successor_first(cluster: str, lighthouse: str, tmp_path: Path) -> None:
    """`python -m launch cancel RUN_DIR` of a live job: the successor waiting behind it is scancelled
    before the job (whose CANCELLED would meet afternotok), so it never runs; the job checkpoints and ends
    cancelled, not requeued, as any Slurm job does."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "live.yaml"
    recipe.write_text(live.config_text(run_dir, steps=4096) + f"  lighthouse: {lighthouse}\n")
    launch = Launch(run_dir, "--nodes", "2", "--tasks-per-node", "1", "--time", "10", "--config", str(recipe))
    first = launch.job_id
    rank0 = run_dir / "trace" / "rank0.jsonl"
    wait_until(lambda: live.traced_step(rank0) >= 2 or launch.proc.poll() is not None, 240, "the first steps")
    assert launch.proc.poll() is None, launch.text()[-3000:]
    after = successor.read(run_dir, first)
    assert after is not None and after.successor is not None
    second = after.successor
    assert status_of(run_dir)["state"] == "running"
    rc, said, err = run_cmd(launcher_argv("launch", "cancel", str(run_dir)), timeout=120)
    assert rc == 0, said + err
    assert said.index(f"scancel {second}") < said.index(f"scancel {first}"), said
    assert launch.finish(120) == CANCELLED, launch.text()[-3000:]
    wait_until(lambda: over(first), 60, f"job {first} to end")
    assert controller(first)["JobState"] == "CANCELLED"
    never = slurm("sacct", "-n", "-X", "-P", "-o", "State,Elapsed,NodeList", "-j", second).strip().split("|")
    assert never[0].startswith("CANCELLED") and never[1:] == ["00:00:00", "None assigned"], never  # never ran
    assert not (run_dir / "slurm" / second / f"{second}_0_log.out").exists()
    assert wait_until(lambda: status_of(run_dir)["state"] == "cancelled", 60, "state cancelled")
