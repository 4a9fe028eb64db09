"""Live recovery across nodes (recovery.live with recovery.lighthouse, issue #37): network-namespace
nodes with their own hostnames, addresses and a real switch; the membership service (`python -m
launch.lighthouse`) on a node of its own; `launch.local --nnodes N --node-rank K --master-addr node0`
on each training node. A whole node is SIGKILLed from outside (every process in its namespace: its
launcher, live agent, rank and loader workers) once its batch trace shows step KILL_AT: a non-first
node, the first one (node0: rank 0, the writer, and the first group's store), and two of four at once.

Then the nodes left finish the run in their own processes (exit 0, no `resumed from`); every global
step's samples, crops and flips are exactly the uninterrupted run's (the batch trace of each step's
last group); the final weights equal it up to float summation order; gradients crossed the nodes by a
gloo all-reduce (not shared memory: the members' hosts differ).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench import live
from faults import netns, progress
from faults.job import REPO, node_env
from faults.netns import Cluster, Node
from tests.conftest import launcher_argv
from tests.integration.test_live_recovery import TOLERANCE, step_samples

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(600)]

DEADLINE_S = 240.0
PORT = 29510


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> live.LiveRun:
    """The uninterrupted run (one node, 2 ranks, nothing killed): the plan does not depend on the world."""
    result = live.run(tmp_path_factory.mktemp("live-netns-ref") / "run", victim=None)
    assert result.code == 0, result.stderr[-3000:]
    return result


def make_cluster(nodes: int):  # noqa: ANN201 - the Cluster context manager
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return Cluster(nodes=nodes)


def start_lighthouse(cluster: Cluster, node: Node, log: Path) -> str:
    """`python -m launch.lighthouse` on `node`; returns its address once it serves."""
    popen = cluster.start(
        node,
        launcher_argv("launch.lighthouse", "--bind", f"0.0.0.0:{PORT}", "--heartbeat-timeout-ms", "1000"),
        log,
        env=node_env(),
        cwd=REPO,
    )
    progress.wait_until(
        lambda: "lighthouse: serving" in log.read_text(errors="replace"),
        60,
        "the membership service",
        lambda: f"it exited {popen.returncode}: {log.read_text()[-2000:]}" if popen.poll() is not None else None,
    )
    return f"http://{node.address}:{PORT}"


def traced(run_dir: Path, rank: int) -> int:
    return live.traced_step(run_dir / "trace" / f"rank{rank}.jsonl")


def run_and_kill(
    tmp_path: Path, training_nodes: int, victims: list[int], nproc: int = 1
) -> tuple[Path, dict[int, int | None], str]:
    """Start the service and `training_nodes` nodes of `nproc` ranks; SIGKILL every process of each
    victim node (all at once) once the first victim's first rank traced step KILL_AT; wait for the
    others. Returns the run dir, each node's launcher code (None: killed) and every log's text."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = tmp_path / "run.yaml"
    with make_cluster(training_nodes + 1) as cluster:
        *nodes, service_node = cluster.nodes
        lighthouse = start_lighthouse(cluster, service_node, tmp_path / "lighthouse.log")
        recipe.write_text(live.config_text(run_dir) + f"  lighthouse: {lighthouse}\n")
        logs = [tmp_path / f"node{n.index}.log" for n in nodes]
        popens = [
            cluster.start(
                node,
                launcher_argv(
                    "launch.local", "--nnodes", str(training_nodes), "--node-rank", str(node.index),
                    "--master-addr", "node0", "--gpus", str(nproc), "--device", "cpu", "--config", str(recipe),
                ),
                log,
                env=node_env(),
                cwd=REPO,
            )
            for node, log in zip(nodes, logs, strict=True)
        ]  # fmt: skip

        def text() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())

        def gone() -> str | None:
            return (
                f"a node ended early {[p.poll() for p in popens]}: {text()}"
                if any(p.poll() is not None for p in popens)
                else None
            )

        progress.wait_until(
            lambda: traced(run_dir, victims[0] * nproc) >= live.KILL_AT, DEADLINE_S, "the kill step", gone
        )
        killed_at = time.time()
        for victim in victims:
            cluster.kill_node(nodes[victim])
        left = [p for k, p in enumerate(popens) if k not in victims]
        progress.wait_until(lambda: all(p.poll() is not None for p in left), DEADLINE_S, "the nodes left to finish")
        codes = {k: (None if k in victims else p.returncode) for k, p in enumerate(popens)}
        (tmp_path / "killed_at").write_text(str(killed_at))
        return run_dir, codes, text()


def check_exact(run_dir: Path, reference: live.LiveRun, out: str) -> None:
    assert step_samples(run_dir) == step_samples(reference.run_dir)
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(reference.run_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **TOLERANCE, msg=lambda m, k=key: f"{k}: {m}")
    assert "gradients: live: one flat gloo all-reduce" in out, "the nodes' hosts differ: no shared memory"
    assert "resumed from" not in out, "a node was restarted"


def regroups(run_dir: Path) -> list[dict]:
    found = []
    for path in sorted((run_dir / "live").glob("events-rank*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in found if e["event"] == "regrouped"]


@pytest.mark.parametrize("victim", [1, 0], ids=["kill-node1", "kill-node0"])
def test_a_whole_node_killed_costs_a_regroup_whichever_node(
    reference: live.LiveRun, victim: int, tmp_path: Path
) -> None:
    run_dir, codes, out = run_and_kill(tmp_path, 2, [victim])
    assert codes[1 - victim] == 0, out
    done = regroups(run_dir)
    assert [(e["world"], e["rank"]) for e in done] == [(1, 0)], done
    assert done[0]["step"] >= live.KILL_AT
    check_exact(run_dir, reference, out)


def test_two_nodes_of_four_killed_at_once(reference: live.LiveRun, tmp_path: Path) -> None:
    run_dir, codes, out = run_and_kill(tmp_path, 4, [1, 2])
    assert codes[0] == 0 and codes[3] == 0, out
    done = regroups(run_dir)
    assert {(e["world"], e["rank"]) for e in done} == {(2, 0), (2, 1)} and len(done) == 2, done
    check_exact(run_dir, reference, out)
