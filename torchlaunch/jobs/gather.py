"""Read a run dir (and, when available, the scheduler) into state.Facts: every side effect of
`status` and `list` lives here, so the decision in state.py stays a pure function.

The scheduler is asked only when its tool is installed, with a short timeout, and its answer is one
JobState in the project's words; a missing tool or a failing query leaves the decision to the run dir.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.base import procs
from torchlaunch.base.files import as_int, read_json, read_range
from torchlaunch.jobs import progress, record, schedulers
from torchlaunch.jobs.lost import unrecorded
from torchlaunch.jobs.state import WORLD_EVENT, Checkpoint, Facts, LiveRegroup, WorldChange, current_launch

METRICS_TAIL_BYTES = 64 << 20
"""How much of metrics.jsonl's end is searched for the last world-size change (~500k records)."""


def newest_checkpoint(run_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies (commit marker, size and checksum: the store's latest_valid,
    what "does this run have a checkpoint" means everywhere), and why newer ones were skipped.
    torchlaunch.core.checkpoint is imported here only, when a checkpoint folder exists: it loads torch,
    which `status` of a run without checkpoints never needs."""
    root = rundir.checkpoints(run_dir)
    if not root.is_dir():
        return None, []
    try:
        from torchlaunch.core import checkpoint as ckpt

        ckpt.latest_valid  # noqa: B018  the package loads its submodules (torch) on first use: here, in the try
    except ModuleNotFoundError as missing:  # a Python without the project's packages: status goes on
        return None, [f"checkpoints not verified: this Python lacks {missing.name} (use .venv/bin/python)"]

    skipped: list[str] = []
    try:
        path = ckpt.latest_valid(root, lambda p, why: skipped.append(f"checkpoint {p.name} skipped: {why}"))
    except (OSError, ValueError) as e:
        return None, [*skipped, f"checkpoints cannot be read ({e})"]
    if path is None:
        return None, skipped
    try:
        committed = (path / ckpt.MARKER_FILE).stat().st_mtime
    except OSError:
        committed = None
    step = ckpt.parse_step(path.name)
    return Checkpoint(step if step is not None else 0, str(path), committed), skipped


def last_world_change(run_dir: Path) -> WorldChange | None:
    """The last world-size change event in metrics.jsonl (its tail), or None; malformed lines skipped."""
    try:
        raw, _ = read_range(rundir.metrics(run_dir), -METRICS_TAIL_BYTES, METRICS_TAIL_BYTES)
    except OSError:
        return None
    needle = WORLD_EVENT.encode()
    for line in reversed(raw.splitlines()):
        if needle not in line:
            continue
        try:
            rec = json.loads(line)  # a forged line: ValueError (not UTF-8, not JSON) or too deep
        except (ValueError, RecursionError):
            continue
        if not isinstance(rec, dict) or rec.get("event") != WORLD_EVENT:
            continue
        step, now, was = (
            as_int(rec.get("step"), 0),
            as_int(rec.get("world_size"), 1),
            as_int(rec.get("previous_world_size"), 1),
        )
        if step is None or now is None or was is None:
            continue
        return WorldChange(step, now, was, as_int(rec.get("nodes"), 1), as_int(rec.get("previous_nodes"), 1))
    return None


LIVE_EVENTS_TAIL_BYTES = 1 << 20
"""How much of each rank's live events file is read (each regroup is one ~200-byte line)."""
REGROUP_DURING = ("step", "validation", "checkpoint", "rejoin")


def live_regroups(run_dir: Path) -> tuple[LiveRegroup, ...]:
    """A live run's regroups from RUN_DIR/live/events-rank*.jsonl, one per group generation (every
    survivor records the same regroup), oldest first. The files are untrusted: bounded reads, regular
    files only, malformed or forged lines skipped."""
    found: dict[int, LiveRegroup] = {}
    stopped: set[int] = set()  # generations whose group was below the launch's minimum
    try:
        paths = sorted(rundir.live(run_dir).glob("events-rank*.jsonl"))[:4096]
    except OSError:
        return ()
    for path in paths:
        try:
            raw, _ = read_range(path, -LIVE_EVENTS_TAIL_BYTES, LIVE_EVENTS_TAIL_BYTES)
        except OSError:
            continue
        for line in raw.splitlines():
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict) and rec.get("event") == "below_minimum":
                generation = as_int(rec.get("generation"), 0)
                if generation is not None:
                    stopped.add(generation)
                continue
            if not isinstance(rec, dict) or rec.get("event") != "regrouped":
                continue
            fields = [as_int(rec.get(k), 0) for k in ("generation", "step", "old_world", "world")]
            during = rec.get("during", "step")
            if any(f is None for f in fields) or during not in REGROUP_DURING:
                continue
            generation, step, was, now = fields
            found.setdefault(generation, LiveRegroup(generation, step, during, was, now))  # type: ignore[arg-type]
    return tuple(dataclasses.replace(found[g], stopped=g in stopped) for g in sorted(found))


def rank_codes(run_dir: Path, launch_id: str) -> list[tuple[int, int, str]]:
    """Records torchlaunch.status left for this launch (read only: the launcher consumes them)."""
    out = []
    for path in sorted(rundir.status(run_dir).glob(f"{launch_id}-rank*.json"))[:4096]:
        data, _ = read_json(path)
        if data is None:
            continue
        code, rank, reason = data.get("code"), data.get("rank"), data.get("reason")
        if isinstance(code, int) and isinstance(rank, int) and not isinstance(code, bool):
            out.append((rank, code, reason if isinstance(reason, str) else ""))
    return out


def scheduler_state(rec: record.JobRecord) -> schedulers.JobState | None:
    """What the record's scheduler says about its job (None: no job id, or it cannot say)."""
    backend = schedulers.get(rec.scheduler)
    return backend.state(rec.job_id, rec.extra) if backend is not None and rec.job_id else None


def gone_ranks(beats: list[progress.RankBeat]) -> frozenset[int]:
    """Ranks whose beat names a process of this host that is no longer running (pid and start time):
    only this host's processes can be told apart from a rank that is merely slow to beat."""
    here = socket.gethostname()
    return frozenset(
        b.rank for b in beats if b.host == here and b.pid is not None and not procs.same_process(b.pid, b.pid_start)
    )


def facts(
    run_dir: Path, *, hang_timeout: float | None = None, ask_scheduler: bool = True, checkpoints: bool = True
) -> Facts:
    """Everything `state.decide` needs; `checkpoints=False` skips verifying them (`list`)."""
    records, problems = record.read_all(run_dir)
    beats, beat_problems = progress.read_all(progress.folder(run_dir))
    checkpoint, skipped = newest_checkpoint(run_dir) if checkpoints else (None, [])
    cancel_launch, _ = record.cancel_request(run_dir)
    nodes = current_launch(records)
    launch = nodes[0].launch_id if nodes else None
    said = scheduler_state(nodes[0]) if nodes and ask_scheduler else None
    return Facts(
        records=records,
        alive={r.node_rank: r.launcher_alive() for r in nodes},
        cancel_launch=cancel_launch,
        cancel_job=record.cancel_job(run_dir),
        rank_codes=rank_codes(run_dir, launch) if launch else (),
        beats=beats,
        checkpoint=checkpoint,
        scheduler_state=said,
        hang_timeout=hang_timeout,
        now=time.time(),
        problems=[*problems, *beat_problems, *skipped],
        world_change=last_world_change(run_dir),
        gone_ranks=gone_ranks(beats),
        regroups=live_regroups(run_dir),
        lost=requeued_loss(run_dir, nodes, said, checkpoint) if checkpoints else "",
    )


def requeued_loss(
    run_dir: Path, nodes: list[record.JobRecord], said: schedulers.JobState | None, newest: Checkpoint | None
) -> str:
    """While the scheduler says a job was preempted or requeued and its last allocation recorded no
    outcome (its processes were killed, as Slurm does when GraceTime runs out), what that allocation
    lost: `status` may read the run before the next allocation does (which says and records it,
    backends.slurm.killed). Counted from `newest`, the checkpoint `status` verified already."""
    if (
        said is None
        or said.word not in ("pending", "requeued", "preempted")
        or not nodes
        or any(r.outcome for r in nodes)
    ):
        return ""
    node0 = min(nodes, key=lambda r: r.node_rank)
    step = newest.step if newest is not None else None
    return unrecorded(run_dir, node0, then="the job resumes from there when it runs again", newest=step)
