"""What the user sees when a run continues on another world size: rank 0's one line, the metrics.jsonl
event, and `python -m launch status` (current world size from the heartbeats, the last change from the
event). Pure functions and hand-written run-dir files; tests/integration/test_resume.py sees them in real runs."""

from __future__ import annotations

import json
from pathlib import Path

from torchlaunch.core.dist import DistContext
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.jobs import cli, gather, progress, state
from torchlaunch.worker.metrics import RunLog, WorldSize, world_change_line


def plan(batch: int, world: int, micro: int = 0) -> BatchPlan:
    return BatchPlan(10_000, batch, 0, 0, world, micro)


def test_the_line_names_nodes_when_the_contract_tells_them() -> None:
    line = world_change_line(480, WorldSize(1, 1), WorldSize(2, 2), plan(48, 1))
    assert line == "node lost: continuing on 1 of 2 nodes from step 480, global batch 48 kept as 1 x 48"
    line = world_change_line(480, WorldSize(12, 3), WorldSize(16, 4), plan(64, 12))
    assert line == (
        "node lost: continuing on 3 of 4 nodes, 12 ranks (was 16) from step 480, global batch 64 kept as 4 x 6 + 8 x 5"
    )
    line = world_change_line(7, WorldSize(4, 2), WorldSize(2, 1), plan(64, 4, 8))
    assert line == (
        "node joined: continuing on 2 nodes (was 1), 4 ranks (was 2) from step 7, global batch 64 kept as 4 x 16 "
        "in 2 micro-steps"
    )


def test_the_line_without_node_counts_names_ranks_and_uneven_shares() -> None:
    line = world_change_line(480, WorldSize(3, 1), WorldSize(2, None), plan(64, 3))
    assert (
        line
        == "world size changed: continuing on 3 ranks (was 2) from step 480, global batch 64 kept as shares 22/21/21"
    )
    same_nodes = world_change_line(5, WorldSize(3, 1), WorldSize(2, 1), plan(64, 3))
    assert same_nodes.startswith("world size changed: continuing on 3 ranks (was 2)")
    one = world_change_line(5, WorldSize(1, 1), WorldSize(2, 1), plan(64, 1))
    assert one == "world size changed: continuing on 1 rank (was 2) from step 5, global batch 64 kept as 1 x 64"


def test_world_size_of_a_context() -> None:
    assert WorldSize.of(DistContext(rank=0, world_size=8, local_world_size=4)) == WorldSize(8, 2)
    assert WorldSize.of(DistContext()) == WorldSize(1, 1)
    assert WorldSize.of(DistContext(rank=0, world_size=5, local_world_size=2)) == WorldSize(5, None)  # uneven nodes


def test_event_in_metrics_and_status_shows_it(tmp_path: Path) -> None:
    log = RunLog(
        tmp_path,
        0,
        epochs=1,
        steps_per_epoch=10,
        total_steps=10,
        global_batch=64,
        start_step=4,
        resume_step=None,
        tensorboard=False,
        trace=False,
    )
    log.world_changed(4, 0, WorldSize(3, 1), WorldSize(2, 2), plan(64, 3))
    log.close()
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [
        {
            "step": 4,
            "epoch": 0,
            "event": "world_size_changed",
            "world_size": 3,
            "previous_world_size": 2,
            "nodes": 1,
            "previous_nodes": 2,
            "shares": "22/21/21",
        }
    ]
    with open(tmp_path / "metrics.jsonl", "a") as f:  # later records and garbage do not hide the event
        f.write('{"step": 5, "loss": 1.0}\nnot json world_size_changed\n{"event": "world_size_changed"}\n')
    change = gather.last_world_change(tmp_path)
    assert change == state.WorldChange(4, 3, 2, 1, 2)
    beat = progress.RankBeat.from_json({"rank": 0, "world_size": 3, "step": 6, "time": 1.0})
    assert beat is not None and beat.world_size == 3
    st = state.decide(state.Facts(beats=[beat], world_change=change, now=2.0))
    assert st.world_change == change
    st = state.Status("running", "making progress", world_size=3, world_change=change)
    text = cli.render_status(tmp_path, st, 2.0)
    assert "world:      3 ranks; last change at step 4: 2 -> 3 ranks, nodes 2 -> 1" in text
    assert st.to_json()["world_change"] == {
        "step": 4,
        "world_size": 3,
        "previous_world_size": 2,
        "nodes": 1,
        "previous_nodes": 2,
    }


def test_no_event_no_world_line(tmp_path: Path) -> None:
    assert gather.last_world_change(tmp_path) is None  # no metrics.jsonl at all
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert gather.last_world_change(tmp_path) is None
    assert "world:" not in cli.render_status(tmp_path, state.Status("running", "x"), 0.0)
