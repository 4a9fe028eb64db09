"""`launch.local --nnodes MIN:MAX` live (issue #37, item 4; the default since issue #54): two nodes on this host, each
its own launcher with its own --node-rank, on loopback, with the membership service apart (a real
`python -m launch.lighthouse`) and one run dir, as two machines would run the same command.

- 1:2, both nodes in at once: the first group is both; node 1 (launcher, agent, rank) SIGKILLed from
  outside -> node 0 trains on in its process to exit 0 (MIN is 1).
- 1:2, node 1 started once node 0's first group formed alone (MIN reached, the last call over): it
  joins that group at a check point with node 0's state, never a group of its own.
- 2:3, two nodes: node 1 SIGKILLed -> node 0 is below MIN: it commits the last whole step and exits
  75 (live/minimum.py); the same two commands again resume.

After each, every global step's samples, crops and flips are the uninterrupted run's (the library's
live references: the plan is a function of (seed, epoch, step), whatever the world or the launcher).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from bench import live
from tests.conftest import REPO, child_env, free_port, launcher_argv, lighthouse_serving, run_cmd
from tests.integration.test_live_recovery import TOLERANCE, step_samples
from tests.library import LIVE_LONG_EPOCHS, SURVIVOR_SHARE, RunLibrary
from torchlaunch import pdeath

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DEADLINE_S = 240.0
LATE_EPOCHS = LIVE_LONG_EPOCHS
"""The late node's run: the library's long live run (3,072 steps); node 0 runs a fifth of the CPU
(SURVIVOR_SHARE) until node 1 has joined, so the late node's start-up (~4 s here) is short against
node 0's steps on any box, as it is against a GPU job's."""


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[str]:
    with lighthouse_serving(tmp_path / "lighthouse.log") as address:
        yield address


@dataclass
class Job:
    """One live job of --nnodes RANGE on this host: the recipe, the ports, each node's launcher."""

    work: Path
    nodes: str
    lighthouse: str
    epochs: int = 1
    master_port: int = 0

    LIVE: ClassVar[bool | None] = True
    """recovery.live in the recipe (None: left out, the default)."""

    def __post_init__(self) -> None:
        self.master_port = self.master_port or free_port()
        self.recipe.write_text(live.config_text(self.run_dir, live=self.LIVE, epochs=self.epochs))

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    @property
    def recipe(self) -> Path:
        return self.work / "run.yaml"

    def numbered(self, node: int) -> tuple[list[str], list[str]]:
        """How this node is numbered and which service it names (PlacedJob: neither)."""
        return ["--node-rank", str(node)], [f"recovery.lighthouse={self.lighthouse}"]

    def start(self, node: int) -> subprocess.Popen:
        """This node's command, as its user types it (one CPU rank; a 1 s last call after MIN)."""
        number, service = self.numbered(node)
        argv = launcher_argv(
            "launch.local",
            "--nnodes",
            self.nodes,
            *number,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(self.master_port),
            "--rdzv-conf",
            "last_call_timeout=1",
            "--gpus",
            "1",
            "--device",
            "cpu",
            "--config",
            str(self.recipe),
            *service,
        )
        env = child_env({"OMP_NUM_THREADS": "1"})  # as the reference's 2 ranks on 2 cores: the same sums
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def trace(self, rank: int) -> int:
        return live.traced_step(self.run_dir / "trace" / f"rank{rank}.jsonl")

    def generation(self) -> int:
        try:
            return int((self.run_dir / "live" / "generation").read_text().strip() or 0)
        except FileNotFoundError:
            return 0


def wait_for(what: str, done: Callable[[], bool], procs: list[subprocess.Popen]) -> None:
    """Poll `done` (a file read) until true; fail with what the launchers said if one ended first."""
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            said = "\n---\n".join((p.communicate()[0] or "")[-2500:] for p in procs)
            pytest.fail(f"{what}: {'a launcher ended first' if ended else 'deadline'}\n{said}")
        time.sleep(0.01)  # polling a file: there is no event to wait on


def kill_node(launcher: subprocess.Popen) -> None:
    """The whole node at once: its launcher and everything under it (agent, rank, loader workers)."""
    for pid in [launcher.pid, *pdeath.descendants(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.communicate(timeout=60)


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each launcher's exit code and output, once it ended (bounded)."""
    done = []
    for p in procs:
        out, _ = p.communicate(timeout=DEADLINE_S)
        done.append((p.returncode, out))
    return done


def same_weights(run_dir: Path, reference: Path, exact: bool) -> None:
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(reference / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], **TOLERANCE, msg=lambda m, k=key: f"{k}: {m}")


def status(run_dir: Path) -> dict:
    rc, shown, err = run_cmd(launcher_argv("launch", "status", str(run_dir), "--json"), timeout=60)
    assert rc == 0, err
    return json.loads(shown)


def test_both_nodes_form_the_first_group_and_node_1_lost_leaves_node_0_training(
    run_library: RunLibrary, lighthouse: str, tmp_path: Path
) -> None:
    reference = run_library.path("live")
    job = Job(tmp_path, "1:2", lighthouse)
    nodes = [job.start(0), job.start(1)]
    wait_for("node 1 at the kill step", lambda: job.trace(1) >= live.KILL_AT, nodes)
    survivor = live.pid_of(job.run_dir, 0)
    kill_node(nodes[1])
    code, out = finish(nodes[:1])[0]
    assert code == 0, out[-3000:]
    assert "the first live group of --nnodes 1:2 is node(s) 0, 1" in out, out[-3000:]
    assert "resumed from" not in out and live.pid_of(job.run_dir, 0) == survivor, "node 0 was restarted"
    regrouped = [e for e in live.LiveRun(job.run_dir, 0, "", None).events() if e["event"] == "regrouped"]
    assert [(e["world"], e["rank"], e["during"]) for e in regrouped] == [(1, 0, "step")], regrouped
    assert step_samples(job.run_dir) == step_samples(reference)
    same_weights(job.run_dir, reference, exact=False)  # 2 ranks' gradients, then 1 rank's: summation order
    st = status(job.run_dir)
    assert (st["state"], st["step"], st["world_size"]) == ("finished", live.STEPS, 1), st
    assert {r["rank"]: r["gone"] for r in st["ranks"]} == {0: False, 1: True}, st["ranks"]


# CI's tier proves the same join (a node's command run after the group formed) on netns nodes:
# tests/engines/faults/test_live_netns.py, replace-node0; this one (50 s) is the extended tier's.
@pytest.mark.extended
def test_a_node_started_after_the_first_group_formed_joins_it(
    run_library: RunLibrary, lighthouse: str, tmp_path: Path
) -> None:
    """Node 0 alone: MIN (1) is in, the last call (1 s) passes, and it forms the first group of one rank.
    Node 1, started once that group formed, finds it sealed without itself: its rank joins at node 0's
    next check point with node 0's state (digest checked), in the first half of the run. Every step is
    the uninterrupted run's (the library's long live run)."""
    job = Job(tmp_path, "1:2", lighthouse, epochs=LATE_EPOCHS)
    first = job.start(0)
    wait_for("node 0's first group", lambda: job.generation() >= 1 and job.trace(0) >= 1, [first])
    with live.held_until_joined(job.run_dir, live.rank_pids(first.pid), SURVIVOR_SHARE) as slowed:
        late = job.start(1)
        (code0, out0), (code1, out1) = finish([first, late])
    assert slowed.turns > 0, "node 0 was never slowed"
    assert (code0, code1) == (0, 0), f"{out0[-2500:]}\n---\n{out1[-2500:]}"
    assert "the first live group of --nnodes 1:2 is node(s) 0; this node's ranks start in it" in out0, out0[-2500:]
    assert "formed without this node (node(s) 0): this node's ranks join it with a peer's state" in out1, out1[-2500:]
    assert re.search(r"live: joined the group at global step \d+ as rank 1 of 2 \(state from rank 0", out1), out1
    events = live.LiveRun(job.run_dir, 0, "", None).events()
    assert [(e["during"], e["world"]) for e in events if e["event"] == "regrouped"] == [("rejoin", 2)], events
    joined = int(re.search(r"joined the group at global step (\d+)", out1).group(1))  # type: ignore[union-attr]
    assert joined < LATE_EPOCHS * live.STEPS // 2, f"joined late in the run: step {joined}"
    assert step_samples(job.run_dir) == step_samples(run_library.path("live-long"))
    st = status(job.run_dir)
    assert (st["state"], st["world_size"]) == ("finished", 2), st
    assert [(r["during"], r["world_size"]) for r in st["regroups"]] == [("rejoin", 2)], st["regroups"]


def test_a_loss_below_min_checkpoints_exits_75_and_the_same_commands_resume_exactly(
    run_library: RunLibrary, lighthouse: str, tmp_path: Path
) -> None:
    """--nnodes 2:3 on two nodes (sealed after the last call: MAX never came). Node 1 SIGKILLed whole:
    node 0's rank regroups alone, below MIN, trains no further step, commits the last whole step and
    exits 75. Both commands again: the run resumes on 2 ranks and ends with the uninterrupted run's
    samples and weights bit for bit (no step trained on another world size)."""
    reference = run_library.path("live")
    job = Job(tmp_path, "2:3", lighthouse)
    nodes = [job.start(0), job.start(1)]
    wait_for("node 1 at the kill step", lambda: job.trace(1) >= live.KILL_AT, nodes)
    kill_node(nodes[1])
    code, out = finish(nodes[:1])[0]
    assert code == 75, out[-3000:]
    found = re.search(
        r"live: 1 node left, below --nnodes 2:3's minimum of 2 nodes: checkpoint committed at global step (\d+); "
        r"exit 75",
        out,
    )
    assert found, out[-3000:]
    step = int(found.group(1))
    assert live.KILL_AT - 1 <= step < live.STEPS and job.trace(0) <= step + 1, out[-3000:]
    st = status(job.run_dir)
    assert [(r["world_size"], r["stopped"]) for r in st["regroups"]] == [(1, True)], st["regroups"]
    again = finish([job.start(0), job.start(1)])
    assert [c for c, _ in again] == [0, 0], "\n---\n".join(o[-2500:] for _, o in again)
    assert f"(global step {step})" in again[0][1] and "resumed from" in again[0][1], again[0][1][-3000:]
    assert step_samples(job.run_dir) == step_samples(reference)
    same_weights(job.run_dir, reference, exact=True)


@dataclass
class PlacedJob(Job):
    """The issue's default command line: no --node-rank (each node takes its slot in the run dir), no
    recovery.* key anywhere (recovery.live's default, auto, is live on several ranks) and no
    recovery.lighthouse (the node agents place the membership service through the run dir's lease)."""

    LIVE: ClassVar[bool | None] = None

    def numbered(self, node: int) -> tuple[list[str], list[str]]:
        return [], []

    def service_host(self, nodes: list[subprocess.Popen]) -> int:
        """Which launcher's node serves the membership service: the newest lease's holder (its agent's pid)."""
        folder = self.run_dir / "live" / "service"
        newest = max(folder.glob("lease-*.json"))
        holder = int(json.loads(newest.read_text())["holder"].split("-")[0])
        (found,) = [i for i, p in enumerate(nodes) if holder in pdeath.descendants(p.pid)]
        return found


@pytest.mark.parametrize("victim", ["node 0 (the service's and the first store's host)", "node 1"])
def test_the_default_command_lines_place_the_service_and_survive_either_nodes_loss(
    run_library: RunLibrary, tmp_path: Path, victim: str
) -> None:
    """Two `--nnodes 1:2` launchers, nothing else given (issue #54: no --node-rank, no recovery.* key in
    the command or the recipe, no service started by hand): live by default, they number themselves
    from the run dir and node 0's agent serves the membership service (node 0 hosts the first group's
    store too).
    Node 0, or node 1, SIGKILLed whole at step 12: the survivor's process trains on alone to exit 0 (when its service was
    lost, the survivor's agent takes the lease and serves), every step's samples are the uninterrupted
    run's."""
    reference = run_library.path("live")
    job = PlacedJob(tmp_path, "1:2", "")
    nodes = [job.start(0), job.start(1)]
    wait_for("both nodes at the kill step", lambda: min(job.trace(0), job.trace(1)) >= live.KILL_AT, nodes)
    host = job.service_host(nodes)
    lost = host if victim.startswith("node 0") else 1 - host
    pids = {rank: live.pid_of(job.run_dir, rank) for rank in (0, 1)}
    kill_node(nodes[lost])
    kept = nodes[1 - lost]
    code, out = finish([kept])[0]
    assert code == 0, out[-4000:]
    assert "launch: road: live" in out, out[-4000:]  # the default's road, said in one line
    node = int(re.search(r"launch: this node is node (\d) of --nnodes 1:2", out).group(1))  # type: ignore[union-attr]
    assert node == (1 if lost == host else 0), "node 0 did not host the service: it takes the first lease"
    assert "resumed from" not in out and live.pid_of(job.run_dir, node) == pids[node], "the survivor was restarted"
    regrouped = [e for e in live.LiveRun(job.run_dir, 0, "", None).events() if e["event"] == "regrouped"]
    assert [(e["world"], e["rank"], e["during"]) for e in regrouped] == [(1, 0, "step")], regrouped
    if lost == host:
        assert "live: this node serves the membership service" in out, out[-4000:]
        assert len(list((job.run_dir / "live" / "service").glob("lease-*.json"))) == 2
    assert step_samples(job.run_dir) == step_samples(reference)
    st = status(job.run_dir)
    assert (st["state"], st["step"], st["world_size"]) == ("finished", live.STEPS, 1), st
    assert {r["rank"]: r["gone"] for r in st["ranks"]} == {node: False, 1 - node: True}, st["ranks"]
