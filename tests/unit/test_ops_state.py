"""The run's state machine over hand-made facts and run dirs (every state), records that are forged,
truncated or not UTF-8, and the text and --json output of `python -m launch status` and `list`."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchlaunch.backends import JobState
from torchlaunch.backends.slurm.states import job_word as slurm_says
from torchlaunch.jobs import cli, gather, progress, record, state
from torchlaunch.jobs.progress import RankBeat
from torchlaunch.jobs.record import JobRecord

NOW = 1_000_000.0
HOST = socket.gethostname()


def rec(**kw: object) -> JobRecord:
    base: dict[str, object] = {"launch_id": "L1", "scheduler": "local", "host": HOST, "started": NOW - 100}
    return JobRecord(**{**base, **kw})  # type: ignore[arg-type]


def beat(rank: int = 0, age: float = 1.0, step: int | None = 10, **kw: object) -> RankBeat:
    base: dict[str, object] = dict(
        rank=rank,
        local_rank=rank,
        launch="L1",
        host=HOST,
        pid=1234 + rank,
        pid_start=1,
        beat=3,
        time=NOW - age,
        step=step,
        total=100,
        epoch=1,
        step_time=0.5,
        images_per_s=256.0,
        dump_signal=None,
        stack_file=None,
    )
    return RankBeat(**{**base, **kw})  # type: ignore[arg-type]


def decide(**kw: object) -> state.Status:
    return state.decide(state.Facts(now=NOW, **kw))  # type: ignore[arg-type]


def test_unknown_without_a_record() -> None:
    st = decide()
    assert st.state == "unknown" and "no job record" in st.reason


def test_running_with_fresh_heartbeats_and_eta() -> None:
    st = decide(records=[rec()], alive={0: True}, beats=[beat(0, step=10), beat(1, step=11)])
    assert st.state == "running"
    assert (st.step, st.total, st.epoch) == (10, 100, 1)
    assert st.eta_s == pytest.approx(90 * 0.5)
    assert st.images_per_s == pytest.approx(512.0)
    assert [r.rank for r in st.ranks] == [0, 1]


def test_the_step_and_eta_are_never_behind_the_newest_checkpoint() -> None:
    """Beats come every few steps; the checkpoint of step 44 says the run got that far (issue 51)."""
    ckpt = state.Checkpoint(44, "/r/checkpoints/step-000000044", NOW - 1)
    st = decide(records=[rec()], alive={0: True}, beats=[beat(0, step=40), beat(1, step=40)], checkpoint=ckpt)
    assert st.step == 44 and st.eta_s == pytest.approx((100 - 44) * 0.5)
    ended = decide(records=[rec(outcome="finished", ended=NOW)], beats=[beat(0, step=None)], checkpoint=ckpt)
    assert ended.step == 44  # a rerun's beat before its first step: the run's step is still known


def test_running_before_any_step() -> None:
    st = decide(records=[rec()], alive={0: True})
    assert st.state == "running" and "no rank reported progress" in st.reason


def test_hung_after_the_default_timeout_and_not_before() -> None:
    old = [beat(0, age=700), beat(1, age=650, step=9)]
    st = decide(records=[rec()], alive={0: True}, beats=old)
    assert st.state == "hung" and "stalled ranks 1, 0" in st.reason  # furthest behind first
    slow = [beat(0, age=700, step_time=20.0)]  # 50 x 20 s = 1000 s: not yet
    assert decide(records=[rec()], alive={0: True}, beats=slow).state == "running"
    assert decide(records=[rec()], alive={0: True}, beats=old, hang_timeout=0).state == "running"
    assert decide(records=[rec()], alive={0: True}, beats=[beat(0, age=20)], hang_timeout=10).state == "hung"


def test_heartbeats_of_an_older_launch_are_ignored() -> None:
    st = decide(records=[rec()], alive={0: True}, beats=[beat(0, age=5000, launch="OLD")])
    assert st.state == "running" and st.ranks == ()


def test_pending_and_requeued_from_the_scheduler() -> None:
    slurm = rec(scheduler="slurm", job_id="42", host="node1")
    assert decide(records=[slurm], scheduler_state=slurm_says("PENDING")).state == "pending"
    assert decide(records=[slurm], scheduler_state=slurm_says("REQUEUED")).state == "requeued"
    preempted = rec(scheduler="slurm", job_id="42", outcome="preempted", code=75, ended=NOW)
    assert decide(records=[preempted], scheduler_state=slurm_says("PENDING")).state == "requeued"
    assert decide(records=[preempted], scheduler_state=None).state == "preempted"
    hung = rec(scheduler="slurm", job_id="42", outcome="hung", code=1, ended=NOW)
    assert decide(records=[hung], scheduler_state=slurm_says("PENDING")).state == "requeued"
    assert decide(records=[hung], scheduler_state=slurm_says("FAILED")).state == "hung"


def test_status_says_what_a_killed_allocation_of_a_requeued_job_lost(tmp_path: Path) -> None:
    """Issue #53 (honest codes): Slurm killed an allocation mid-save (GraceTime ran out) and requeued the
    job: no process recorded an outcome, so `status`, reading the run before the next allocation does,
    says the steps its ranks trained past the newest checkpoint; not once the allocation has an outcome
    or while it runs."""
    import dataclasses

    record.start(tmp_path, scheduler="slurm", command=["launch.slurm"], launch_id="42-0", job_id="42")
    progress.folder(tmp_path).mkdir(parents=True)
    (progress.folder(tmp_path) / "rank-0.json").write_text(json.dumps({"rank": 0, "launch": "42-0", "step": 9}))
    nodes, _ = record.read_all(tmp_path)
    newest = state.Checkpoint(4, str(tmp_path / "checkpoints" / "step-000000004"), None)
    pending = slurm_says("PENDING")
    lost = gather.requeued_loss(tmp_path, nodes, pending, newest)
    assert "allocation 42-0 of job 42 ended without a word" in lost, lost
    assert "at least 5 step(s) trained since the checkpoint of step 4 are lost (exit 1)" in lost, lost
    st = decide(records=nodes, scheduler_state=pending, lost=lost)
    assert st.state == "pending" and st.reason == f"scheduler says {pending.said}; {lost}"
    assert gather.requeued_loss(tmp_path, nodes, slurm_says("RUNNING"), newest) == ""
    ended = [dataclasses.replace(nodes[0], outcome="preempted", code=75)]
    assert gather.requeued_loss(tmp_path, ended, pending, newest) == ""
    assert gather.requeued_loss(tmp_path, nodes, pending, state.Checkpoint(9, "step-000000009", None)) == ""


def test_a_schedulers_note_is_printed_beside_the_state() -> None:
    """A backend's note (a live Slurm job's successor waiting behind it) reaches `status` as a note line;
    the state is still decided from the word and the heartbeats."""
    note = "successor job 501 is PENDING behind job 500: it resumes the run if this job's batch host is lost"
    slurm = rec(scheduler="slurm", job_id="500")
    st = decide(records=[slurm], alive={0: True}, beats=[beat(0)], scheduler_state=JobState("running", "RUNNING", note))
    assert (st.state, st.problems) == ("running", (note,))
    assert f"note:       {note}" in cli.render_status(Path("/r"), st, NOW).splitlines()
    assert decide(records=[slurm], alive={0: True}, scheduler_state=slurm_says("RUNNING")).problems == ()


@pytest.mark.parametrize("outcome", ["finished", "failed", "bad_input", "preempted", "hung", "cancelled"])
def test_recorded_outcomes(outcome: str) -> None:
    st = decide(records=[rec(outcome=outcome, code=0, ended=NOW - 5, reason=f"why {outcome}")], alive={0: False})
    assert st.state == outcome and st.reason == f"why {outcome}"


def test_the_worst_node_outcome_wins() -> None:
    nodes = [rec(nnodes=2, outcome="finished"), rec(node_rank=1, nnodes=2, outcome="failed", reason="node 1 died")]
    st = decide(records=nodes, alive={0: False, 1: False})
    assert (st.state, st.reason) == ("failed", "node 1 died")
    partial = [rec(nnodes=2, outcome="finished"), rec(node_rank=1, nnodes=2)]
    assert decide(records=partial, alive={0: False, 1: True}).state == "running"


def test_a_launcher_gone_without_an_outcome() -> None:
    assert decide(records=[rec(launcher_pid=99)], alive={0: False}).state == "failed"
    codes = [(0, 2, "config error: optim.lr: must be > 0")]
    st = decide(records=[rec()], alive={0: False}, rank_codes=codes)
    assert (st.state, st.reason) == ("bad_input", "config error: optim.lr: must be > 0")
    assert decide(records=[rec()], alive={0: False}, rank_codes=[(0, 75, "")]).state == "preempted"


def test_cancelled_and_cancel_of_an_older_launch() -> None:
    ended = rec(outcome="preempted", code=75, ended=NOW)
    assert decide(records=[ended], cancel_launch="L1").state == "cancelled"
    killed = rec(outcome="failed", code=1, ended=NOW)  # a program without a SIGTERM handler
    assert decide(records=[killed], cancel_launch="L1").state == "cancelled"
    assert decide(records=[rec(outcome="finished", ended=NOW)], cancel_launch="L1").state == "finished"
    assert decide(records=[rec()], alive={0: False}, cancel_launch="L1").state == "cancelled"
    slurm = rec(scheduler="slurm", job_id="7")
    assert (
        decide(records=[slurm], cancel_launch="L1", scheduler_state=slurm_says("CANCELLED by 1000")).state
        == "cancelled"
    )
    running = decide(records=[rec()], alive={0: True}, cancel_launch="L1")
    assert running.state == "running" and running.cancel_requested
    newer = rec(launch_id="L2", started=NOW - 10)
    assert decide(records=[ended, newer], alive={0: True}, cancel_launch="L1").state == "running"


def test_slurm_states_reach_the_project_in_its_own_words() -> None:
    assert slurm_says("CANCELLED by 1000") == JobState("cancelled", "CANCELLED by 1000")
    assert slurm_says("COMPLETED") == JobState("finished", "COMPLETED")
    assert slurm_says("OUT_OF_MEMORY").word == "failed"
    assert slurm_says("whatever") is None and slurm_says("") is None and slurm_says(None) is None


def test_a_backend_cannot_speak_outside_the_projects_words() -> None:
    with pytest.raises(ValueError, match="not one of"):
        JobState("COMPLETED", "COMPLETED")
    assert decide(records=[rec(scheduler="slurm", job_id="3")], scheduler_state=slurm_says("TIMEOUT")).state == "failed"


# --- run dirs on disk -------------------------------------------------------------------------------


def write(path: Path, data: bytes | str | dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, dict):
        data = json.dumps(data)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def status_of(run: Path, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(["status", str(run), "--no-scheduler", *extra], out=out)
    return code, out.getvalue()


@pytest.fixture
def live_process():
    """A real process standing in for a launcher: alive until the test ends."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield child
    child.stdin.close()
    child.wait(timeout=30)


def test_newest_verified_checkpoint(tmp_path: Path) -> None:
    from torchlaunch.core import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    ckpt.write_checkpoint(root, 10, {"format_version": ckpt.FORMAT_VERSION, "x": 1}, {})
    newer = ckpt.write_checkpoint(root, 20, {"format_version": ckpt.FORMAT_VERSION, "x": 2}, {})
    with open(newer.path / ckpt.STATE_FILE, "r+b") as f:  # same size, other bytes: only the checksum tells
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    write(record.record_path(tmp_path), {"launch_id": "c1", "outcome": "preempted", "code": 75, "ended": time.time()})
    code, text = status_of(tmp_path, "--json")
    data = json.loads(text)
    assert data["state"] == "preempted"
    assert data["checkpoint"]["step"] == 10 and data["checkpoint"]["age_s"] >= 0
    assert any("step-000000020 skipped: checksum mismatch" in p for p in data["problems"])


GARBAGE = [
    b"",
    b'{"launch_id": "a", "scheduler": "lo',  # truncated
    b"\xff\xfe\x00garbage",  # not UTF-8
    b"[1, 2, 3]",
    b"{" * 100000,  # nested too deeply / huge
    b'{"launch_id": "../../etc", "launcher_pid": 1}',
    b'{"launch_id": "*", "started": "yesterday"}',
    json.dumps({"launch_id": "ok1", "launcher_pid": "1", "started": [], "command": "rm -rf /", "nnodes": -3}).encode(),
    json.dumps({"launch_id": "ok2", "host": "\x1b[31mred\x1b[0m", "outcome": "exploded", "extra": [1]}).encode(),
]


@pytest.mark.parametrize("blob", GARBAGE, ids=range(len(GARBAGE)))
def test_forged_or_broken_records_never_crash_status(tmp_path: Path, blob: bytes) -> None:
    write(record.record_path(tmp_path), blob)
    write(progress.beat_path(progress.folder(tmp_path), 0), blob)
    write(tmp_path / "job" / record.CANCEL_FILE, blob)
    write(tmp_path / "status" / "ok1-rank0.json", blob)
    code, text = status_of(tmp_path)
    assert code == 0 and "state:" in text
    assert "\x1b" not in text  # values are data: a terminal escape is shown, not executed
    code, text = status_of(tmp_path, "--json")
    data = json.loads(text)
    assert data["state"] in state.STATES
    recs, problems = record.read_all(tmp_path)
    for r in recs:  # what survived reading is well-typed
        assert r.launcher_pid is None or r.launcher_pid > 1
        assert isinstance(r.command, tuple) and r.outcome in (None, *record.OUTCOMES) and r.nnodes >= 1


def test_forged_pid_is_never_trusted(tmp_path: Path) -> None:
    write(
        record.record_path(tmp_path),
        {"launch_id": "f1", "host": HOST, "launcher_pid": os.getppid(), "launcher_start": 1},
    )
    recs, _ = record.read_all(tmp_path)
    assert recs[0].launcher_alive() is False  # start time does not match: not the recorded process


def test_record_start_and_finish_round_trip(tmp_path: Path) -> None:
    r = record.start(tmp_path, scheduler="local", command=["python", "-m", "launch.local"], local_ranks=2)
    recs, problems = record.read_all(tmp_path)
    assert problems == [] and recs[0].launcher_pid == os.getpid() and recs[0].command == r.command
    assert state.decide(gather.facts(tmp_path, ask_scheduler=False)).state == "running"
    record.finish(tmp_path, r, 0, "finished", "done")
    assert state.decide(gather.facts(tmp_path, ask_scheduler=False)).state == "finished"
    with pytest.raises(ValueError):
        record.finish(tmp_path, r, 0, "exploded")


def test_list_text_and_json(tmp_path: Path) -> None:
    write(record.record_path(tmp_path / "a"), {"launch_id": "a1", "outcome": "finished", "ended": time.time() - 3600})
    write(record.record_path(tmp_path / "b"), {"launch_id": "b1", "outcome": "bad_input", "ended": time.time()})
    write(progress.beat_path(progress.folder(tmp_path / "b"), 0), {"rank": 0, "launch": "b1", "step": 7, "total": 9})
    (tmp_path / "not-a-run").mkdir()
    out = io.StringIO()
    assert cli.main(["list", str(tmp_path), "--no-scheduler"], out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["RUN", "STATE", "STEP", "AGE"] and len(lines) == 3
    assert lines[1].split()[:3] == ["a", "finished", "-"] and lines[1].split()[3].startswith("60m")
    assert lines[2].split()[:3] == ["b", "bad_input", "7/9"]
    out = io.StringIO()
    assert cli.main(["list", str(tmp_path), "--json", "--no-scheduler"], out=out) == 0
    data = json.loads(out.getvalue())
    assert [(d["state"], d["step"]) for d in data] == [("finished", None), ("bad_input", 7)]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", str(tmp_path / "nope")]) == 2
    assert cli.main(["list", str(tmp_path / "nope")]) == 2
    assert cli.main(["cancel", str(tmp_path)]) == 2
    assert cli.main(["status", str(tmp_path), "--hang-timeout", "-1"]) == 2
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 and all(line.startswith("launch error: ") for line in err)
    assert "does not exist" in err[0] and "no job record" in err[2]


def test_scheduler_from_the_launchers_environment() -> None:
    assert record.scheduler_from_env({}) == ("local", None, {})
    assert record.scheduler_from_env({"SLURM_JOB_ID": "77"}) == ("slurm", "77", {})
    array = {"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "79", "SLURM_ARRAY_TASK_ID": "1"}
    assert record.scheduler_from_env(array) == ("slurm", "79_1", {})
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", record.K8S_JOB_ENV: "cifar", record.K8S_NAMESPACE_ENV: "ml"}
    assert record.scheduler_from_env(pod) == ("k8s", "cifar", {"namespace": "ml"})
    assert record.scheduler_from_env({record.K8S_JOB_ENV: "cifar"})[0] == "local"  # not in a pod


def test_ops_modules_import_neither_torch_nor_the_top_level_commands() -> None:
    import ast

    # checkpoint verification: `status` only with checkpoints, steps lost only when steps were trained
    allowed_lazy = {("gather.py", "torchlaunch.core"), ("lost.py", "torchlaunch.core")}
    for path in sorted((Path(__file__).resolve().parents[2] / "torchlaunch" / "jobs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in ("launch", "train", "torch", "numpy"), f"{path.name} imports {name}"
                if name.startswith("torchlaunch.") and not name.startswith(
                    (
                        "torchlaunch.jobs",
                        "torchlaunch.exit_codes",
                        "torchlaunch.base",
                        "torchlaunch.backends",
                        "torchlaunch.rundir",
                    )
                ):
                    assert (path.name, name) in allowed_lazy, f"{path.name} imports {name}"


# ---- an elastic job: several launchers, each its own launch, one job to status and cancel


def elastic(slot: int, launch: str, **kw: object) -> JobRecord:
    return rec(launch_id=launch, node_rank=slot, extra={record.ELASTIC_JOB: "tl-job@h:29500"}, **kw)


def test_an_elastic_job_is_all_of_its_launchers() -> None:
    a, b = elastic(0, "LA", started=NOW - 100), elastic(1, "LB", started=NOW - 90)
    older = elastic(2, "LOLD", started=NOW - 5000, outcome="finished", ended=NOW - 4000)
    other = rec(launch_id="LX", node_rank=3, started=NOW - 200)
    assert {r.launch_id for r in state.current_launch([a, b, older, other])} == {"LA", "LB"}
    st = decide(records=[a, b], alive={0: True, 1: True}, beats=[beat(0, launch="LA"), beat(1, launch="LB")])
    assert st.state == "running" and len(st.ranks) == 2  # both launchers' ranks, not the newest's alone


def test_an_elastic_job_on_fewer_nodes_is_running_degraded_and_names_the_lost_node() -> None:
    """On 9d2744e: `failed` (the newest launcher's record alone, its pid gone)."""
    a, b = elastic(0, "LA", started=NOW - 100), elastic(1, "LB", started=NOW - 90, host="node-b")
    st = decide(records=[a, b], alive={0: True, 1: False}, beats=[beat(0, launch="LA")])
    assert st.state == "running"
    assert "degraded: 1 of 2 nodes train on" in st.reason and "node slot 1 on node-b (launcher gone)" in st.reason
    ended = elastic(1, "LB", started=NOW - 90, outcome="failed", ended=NOW - 10)
    assert "(failed)" in decide(records=[a, ended], alive={0: True}, beats=[beat(0, launch="LA")]).reason


def test_a_cancel_of_an_elastic_job_covers_every_launcher(tmp_path: Path) -> None:
    a, b = elastic(0, "LA", started=NOW - 100), elastic(1, "LB", started=NOW - 90)
    record.request_cancel(tmp_path, "LB", "signal,signal", "tl-job@h:29500")
    assert record.cancel_requested(tmp_path, "LA", "tl-job@h:29500")  # the other launcher's end: cancelled
    assert not record.cancel_requested(tmp_path, "LA")  # a plain launch is matched by its own id only
    done = [elastic(0, "LA", outcome="cancelled", ended=NOW), elastic(1, "LB", outcome="cancelled", ended=NOW)]
    st = decide(records=done, cancel_launch="LB", cancel_job="tl-job@h:29500")
    assert st.state == "cancelled" and st.cancel_requested
    stopping = decide(records=[a, b], alive={0: True, 1: True}, cancel_launch="LB", cancel_job="tl-job@h:29500")
    assert stopping.cancel_requested


def test_a_rank_lost_in_a_live_regroup_no_longer_speaks_for_the_run() -> None:
    """recovery.live: rank 0 was SIGKILLed at step 12 and rank 1 trains on alone; rank 0's last beat
    (step 12, world 2) must hold neither `step` nor `world` back, and it is shown as gone."""
    change = state.WorldChange(step=12, world_size=1, previous_world_size=2)
    beats = [beat(0, age=30, step=12, world_size=2), beat(1, age=1, step=40, world_size=2)]
    st = decide(records=[rec()], alive={0: True}, beats=beats, world_change=change, gone_ranks=frozenset({0}))
    assert st.state == "running" and st.step == 40 and st.world_size == 1
    assert [(r.rank, r.gone) for r in st.ranks] == [(0, True), (1, False)]
    assert st.to_json()["ranks"][0]["gone"] is True
    shown = [line for line in cli.render_status(Path("run"), st, NOW).splitlines() if line.startswith("rank ")]
    assert "process gone" in shown[0] and "process gone" not in shown[1]
    # the run ended: both processes are gone, and the rank that stepped past the change speaks
    ended = decide(
        records=[rec(outcome="finished", code=0, ended=NOW)],
        alive={0: False},
        beats=[beat(0, age=30, step=12), beat(1, age=1, step=64)],
        world_change=change,
        gone_ranks=frozenset({0, 1}),
    )
    assert ended.state == "finished" and ended.step == 64
    assert [(r.rank, r.gone) for r in ended.ranks] == [(0, True), (1, False)]
    # no rank lost: every beat speaks, none is marked
    same = decide(records=[rec()], alive={0: True}, beats=[beat(0, step=10), beat(1, step=11)])
    assert same.step == 10 and not any(r.gone for r in same.ranks)


def test_gone_ranks_are_this_hosts_ended_processes() -> None:
    from torchlaunch.base import procs

    me = beat(0, pid=os.getpid(), pid_start=procs.start_ticks(os.getpid()))
    ended = beat(1, pid=os.getpid(), pid_start=(procs.start_ticks(os.getpid()) or 0) + 1)  # the pid, reused later
    elsewhere = beat(2, host="another-host", pid=os.getpid(), pid_start=1)  # cannot be told from here
    assert gather.gone_ranks([me, ended, elsewhere]) == frozenset({1})


def test_a_live_runs_regroups_are_read_once_each_and_shown(tmp_path: Path) -> None:
    """Every survivor records the same regroup (one per group generation): `status` shows each once,
    with what ran again; forged, malformed and linked-in lines are skipped, never a traceback."""
    live = tmp_path / "live"
    live.mkdir()
    first = {"event": "regrouped", "generation": 2, "step": 25, "old_world": 3, "world": 2, "during": "validation"}
    second = {"event": "regrouped", "generation": 3, "step": 40, "old_world": 2, "world": 1}  # older: no `during`
    (live / "events-rank1.jsonl").write_text(
        "\n".join([json.dumps(first), json.dumps({"event": "stepped", "step": 25}), json.dumps(second)]) + "\n"
    )
    forged = [
        json.dumps({**first, "generation": 4, "during": "a\nb"}),
        json.dumps({**first, "generation": True}),
        json.dumps({**first, "generation": 5, "step": -1}),
        "[" * 100_000,
        "\udcff not json",
    ]
    (live / "events-rank2.jsonl").write_text("\n".join([json.dumps(first), *forged]) + "\n", errors="surrogateescape")
    os.mkfifo(live / "events-rank3.jsonl")  # a FIFO where a file goes: skipped, never waited on
    regroups = gather.live_regroups(tmp_path)
    assert [(r.generation, r.step, r.during, r.previous_world_size, r.world_size) for r in regroups] == [
        (2, 25, "validation", 3, 2),
        (3, 40, "step", 2, 1),
    ]
    st = decide(records=[rec()], alive={0: True}, beats=[beat(1, step=41)], regroups=regroups)
    shown = cli.render_status(Path("run"), st, NOW)
    assert (
        "live:       2 regroup(s): validation after step 24 re-run (3 -> 2 ranks); step 40 re-run (2 -> 1 ranks)"
        in shown
    )
    assert st.to_json()["regroups"][1] == {
        "generation": 3,
        "step": 40,
        "during": "step",
        "previous_world_size": 2,
        "world_size": 1,
        "stopped": False,
    }
    assert gather.live_regroups(tmp_path / "not-a-run") == ()


def test_a_group_stopped_below_the_launchs_minimum_is_shown_as_such(tmp_path: Path) -> None:
    """A regroup whose group was below --nodes MIN-MAX's minimum ran nothing again: it committed the step
    before and exited 75 for a requeue, and `status` says so rather than 're-run'."""
    live = tmp_path / "live"
    live.mkdir()
    regrouped = {"event": "regrouped", "generation": 2, "step": 16, "old_world": 2, "world": 1, "during": "step"}
    below = {"event": "below_minimum", "generation": 2, "step": 15, "world": 1}
    forged = {"event": "below_minimum", "generation": "x"}
    (live / "events-rank0.jsonl").write_text("\n".join(json.dumps(r) for r in (regrouped, forged, below)) + "\n")
    regroups = gather.live_regroups(tmp_path)
    assert [(r.generation, r.stopped) for r in regroups] == [(2, True)]
    shown = cli.render_status(Path("run"), decide(records=[rec()], alive={0: True}, regroups=regroups), NOW)
    assert (
        "live:       1 regroup(s): 2 -> 1 ranks before step 16, below the launch's minimum: checkpoint of step 15, "
        "exit 75 for a requeue" in shown
    )


def test_a_run_cancelled_in_a_live_regroup_shows_the_step_its_group_reached() -> None:
    """Issue 52: a cancel issued during a regroup ended the run before any rank stepped past the world
    change; the rank lost there (its last beat the first one, step 1) held `step` at 1/192. The ranks
    that reached the change speak for the ended run."""
    change = state.WorldChange(step=37, world_size=1, previous_world_size=2)
    ended = decide(
        records=[rec(outcome="cancelled", code=75, ended=NOW)],
        alive={0: False},
        beats=[beat(0, age=40, step=1, total=192), beat(1, age=1, step=37, total=192)],
        world_change=change,
        gone_ranks=frozenset({0, 1}),
    )
    assert ended.step == 37 and ended.total == 192
