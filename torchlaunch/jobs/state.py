"""The run's state, decided from what the run dir (and optionally the scheduler) says: a pure function.

Inputs are facts already read (`Facts`): the nodes' job records, the cancel request, whether each
local launcher still runs, rank status records left behind, heartbeats, the newest verified
checkpoint and the scheduler's own word for the job. `decide` turns them into one of STATES plus the
numbers `status` prints. The rules, in order (docs/OPERATING.md has the picture):

1. no job record                          -> unknown
2. every node recorded an outcome         -> the worst outcome (bad_input > hung > cancelled > failed >
   preempted > finished); preempted or failed becomes cancelled under a cancel request for that launch,
   and preempted, hung or failed becomes requeued when the scheduler queued or restarted the same job
3. a cancel request and the job is gone   -> cancelled
4. the scheduler says the job ended       -> its word (COMPLETED finished, CANCELLED cancelled, ...)
5. a launcher is gone without an outcome  -> the ranks' records (2 bad_input, 75 preempted) else failed
6. the scheduler says pending             -> pending (requeued after a preemption)
7. running, but no rank progressed for the hang timeout -> hung; else running
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchlaunch.exit_codes import BAD_INPUT, PREEMPTED
from torchlaunch.jobs import watchdog
from torchlaunch.jobs.progress import RankBeat
from torchlaunch.jobs.record import JobRecord, elastic_job
from torchlaunch.jobs.schedulers import JobState

STATES = (
    "pending",
    "running",
    "preempted",
    "requeued",
    "finished",
    "failed",
    "bad_input",
    "hung",
    "cancelled",
    "unknown",
)
SEVERITY = ("bad_input", "hung", "cancelled", "failed", "preempted", "finished")

WORLD_EVENT = "world_size_changed"
"""The `event` of the metrics.jsonl record the worker writes when a run continues on another world size."""


@dataclass(frozen=True)
class WorldChange:
    """The last world-size change of a run (its metrics.jsonl event): at `step`, from `previous_*`."""

    step: int
    world_size: int
    previous_world_size: int
    nodes: int | None = None
    previous_nodes: int | None = None

    def text(self) -> str:
        nodes = ""
        if self.nodes is not None and self.previous_nodes is not None and self.nodes != self.previous_nodes:
            nodes = f", nodes {self.previous_nodes} -> {self.nodes}"
        return f"step {self.step}: {self.previous_world_size} -> {self.world_size} ranks{nodes}"


@dataclass(frozen=True)
class LiveRegroup:
    """One regroup of a live run (recovery.live; RUN_DIR/live/events-rank<r>.jsonl): at `step` (the
    step it ran again, or the one after the validation or checkpoint it interrupted), to `world_size`."""

    generation: int
    step: int
    during: str
    previous_world_size: int
    world_size: int
    stopped: bool = False
    """The group it formed was below the launch's minimum (live/minimum.py): it ran nothing
    again, committed the step before `step` and exited 75 for a requeue."""

    def text(self) -> str:
        if self.stopped:
            return (
                f"{self.previous_world_size} -> {self.world_size} ranks before step {self.step}, below the "
                f"launch's minimum: checkpoint of step {self.step - 1}, exit 75 for a requeue"
            )
        if self.during == "rejoin":
            return f"rank(s) rejoined before step {self.step} ({self.previous_world_size} -> {self.world_size} ranks)"
        what = (
            f"step {self.step} re-run" if self.during == "step" else f"{self.during} after step {self.step - 1} re-run"
        )
        return f"{what} ({self.previous_world_size} -> {self.world_size} ranks)"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    committed: float | None  # the marker's mtime


@dataclass(frozen=True)
class Facts:
    records: Sequence[JobRecord] = ()
    alive: dict[int, bool | None] = field(default_factory=dict)  # node rank -> launcher runs (None: cannot tell)
    cancel_launch: str | None = None
    cancel_job: str | None = None  # an elastic job cancelled as a whole (record.cancel_job)
    rank_codes: Sequence[tuple[int, int, str]] = ()  # (rank, code, reason) from torchlaunch.status records
    beats: Sequence[RankBeat] = ()
    checkpoint: Checkpoint | None = None
    scheduler_state: JobState | None = None  # what the job's backend says, in our words
    hang_timeout: float | None = None  # None: the default; 0: disabled
    now: float = 0.0
    problems: Sequence[str] = ()
    world_change: WorldChange | None = None
    gone_ranks: frozenset[int] = frozenset()
    """Ranks whose heartbeat names a process on this host that has ended (gather.gone_ranks): after a
    live regroup (recovery.live) the run trains on without them, and their last beat is history."""
    regroups: tuple[LiveRegroup, ...] = ()
    """A live run's regroups, oldest first (gather.live_regroups)."""
    lost: str = ""
    """The line of steps lost by an allocation that ended without an outcome while its scheduler says the
    job was preempted or requeued (gather.requeued_loss); '' when none."""


@dataclass(frozen=True)
class RankView:
    rank: int
    host: str | None
    step: int | None
    age_s: float | None
    pid: int | None
    gone: bool = False
    """Lost while other ranks trained on (live regroup): its beat no longer speaks for the run."""


@dataclass(frozen=True)
class Status:
    state: str
    reason: str
    scheduler: str | None = None
    job_id: str | None = None
    launch_id: str | None = None
    hosts: tuple[str, ...] = ()
    started: float | None = None
    step: int | None = None
    total: int | None = None
    epoch: int | None = None
    """The heartbeat's epoch index, from 0 as stored (and in --json); `status` prints it from 1."""
    images_per_s: float | None = None
    eta_s: float | None = None
    last_progress_age_s: float | None = None
    checkpoint: Checkpoint | None = None
    checkpoint_age_s: float | None = None
    ranks: tuple[RankView, ...] = ()
    cancel_requested: bool = False
    problems: tuple[str, ...] = ()
    world_size: int | None = None
    """The ranks of the running attempt (its heartbeats' WORLD_SIZE)."""
    world_change: WorldChange | None = None
    regroups: tuple[LiveRegroup, ...] = ()
    """Live mode's regroups: which ranks were lost when, and what ran again."""

    def to_json(self) -> dict[str, object]:
        ckpt = self.checkpoint
        return {
            "state": self.state,
            "reason": self.reason,
            "scheduler": self.scheduler,
            "job_id": self.job_id,
            "launch_id": self.launch_id,
            "hosts": list(self.hosts),
            "started": self.started,
            "step": self.step,
            "total": self.total,
            "epoch": self.epoch,
            "images_per_s": self.images_per_s,
            "eta_s": self.eta_s,
            "last_progress_age_s": self.last_progress_age_s,
            "checkpoint": None
            if ckpt is None
            else {"step": ckpt.step, "path": ckpt.path, "age_s": self.checkpoint_age_s},
            "ranks": [
                {"rank": r.rank, "host": r.host, "step": r.step, "age_s": r.age_s, "pid": r.pid, "gone": r.gone}
                for r in self.ranks
            ],
            "cancel_requested": self.cancel_requested,
            "problems": list(self.problems),
            "world_size": self.world_size,
            "world_change": None if self.world_change is None else dataclasses.asdict(self.world_change),
            "regroups": [dataclasses.asdict(r) for r in self.regroups],
        }


def current_launch(records: Sequence[JobRecord]) -> list[JobRecord]:
    """The records of the newest launch (the one whose node record started last). An elastic job is one
    launch of several launchers, each with its own id: the newest one's job, every launcher of it that
    still runs or ended after the newest one started (an older run of the same job is not part of it)."""
    if not records:
        return []
    newest = max(records, key=lambda r: (r.started or 0.0, r.node_rank == 0))
    job = elastic_job(newest)
    if job is None:
        return [r for r in records if r.launch_id == newest.launch_id]
    since = newest.started or 0.0
    return [r for r in records if elastic_job(r) == job and (r.outcome is None or (r.ended or 0.0) >= since)]


def degraded(facts: Facts, nodes: Sequence[JobRecord], left: Sequence[JobRecord] = ()) -> str | None:
    """For an elastic or live job training on fewer nodes than it had: `degraded: K of N nodes (lost:
    ...)`; `left`: launchers whose ranks all left the live group (a node lost whole)."""
    if len(nodes) < 2 or elastic_job(nodes[0]) is None:
        return None
    live = [r for r in nodes if r.outcome is None and facts.alive.get(r.node_rank) is not False and r not in left]
    lost = [r for r in nodes if r not in live]
    if not live or not lost:
        return None

    def why(r: JobRecord) -> str:
        if r.outcome or facts.alive.get(r.node_rank) is False or r not in left:
            return r.outcome or "launcher gone"
        return "its ranks left the group"  # on another host: its launcher cannot be looked up

    names = ", ".join(f"node slot {r.node_rank} on {r.host or '?'} ({why(r)})" for r in lost)
    return f"degraded: {len(live)} of {len(nodes)} nodes train on (lost: {names})"


def _worst(outcomes: Sequence[str]) -> str:
    return min(outcomes, key=SEVERITY.index)


def cancel_asked(facts: Facts, nodes: Sequence[JobRecord]) -> bool:
    """A cancel request names this launch, or the elastic job its launchers belong to."""
    job = elastic_job(nodes[0]) if nodes else None
    return any(facts.cancel_launch == r.launch_id for r in nodes) or (job is not None and facts.cancel_job == job)


def left_behind(every: list[RankBeat], change: WorldChange | None) -> frozenset[int]:
    """Ranks that stayed behind the last world change while others stepped past it: lost to a live
    regroup wherever they ran (a rank of another host cannot be looked up by its pid). A member whose
    next beat is still due is counted until it beats (a beat comes every few steps)."""
    if change is None or not any(b.step is not None and b.step > change.step for b in every):
        return frozenset()
    return frozenset(b.rank for b in every if b.step is None or b.step <= change.step)


def _silent_launcher(node: JobRecord, every: list[RankBeat], beats: list[RankBeat]) -> bool:
    """Whether every rank this launcher started has left the run's speaking ranks (a node lost whole
    while the others train on: its launcher wrote no outcome, and on another host it cannot be checked)."""
    own = [b for b in every if b.launch == node.launch_id]
    return bool(own) and not any(b in beats for b in own) and len(beats) > 0


def _state(
    facts: Facts, nodes: list[JobRecord], beats: list[RankBeat], left: Sequence[JobRecord] = ()
) -> tuple[str, str]:
    cancel = cancel_asked(facts, nodes)
    word = facts.scheduler_state.word if facts.scheduler_state is not None else None
    said = facts.scheduler_state.said if facts.scheduler_state is not None else None
    ended = [r for r in nodes if r.outcome is not None]
    if ended and len(ended) == len(nodes):  # a node that never started wrote no record: it cannot be waited for
        outcome = _worst([r.outcome for r in ended if r.outcome])
        why = next((r.reason for r in ended if r.outcome == outcome and r.reason), "") or f"launcher recorded {outcome}"
        if outcome in ("preempted", "failed") and cancel:
            return "cancelled", "cancelled on request; the same launch command resumes from the newest checkpoint"
        if outcome in ("preempted", "hung", "failed") and word in ("pending", "requeued", "running"):
            return "requeued", f"{outcome}, then requeued by the scheduler (now {said})"
        return outcome, why
    gone = [r for r in nodes if r.outcome is None and facts.alive.get(r.node_rank) is False]
    if cancel and (gone or word in ("cancelled", "finished", "failed", "preempted")):
        return "cancelled", "cancelled on request"
    if word in ("finished", "cancelled", "failed", "preempted") and not any(
        facts.alive.get(r.node_rank) for r in nodes
    ):
        return word, f"scheduler says {said}" + (f"; {facts.lost}" if facts.lost else "")
    fewer = degraded(facts, [*nodes, *left], left)
    if fewer is not None:
        return "running", fewer + ("; cancel requested" if cancel else "")
    if gone:
        codes = {code for _, code, _ in facts.rank_codes}
        host = gone[0].host or "?"
        if BAD_INPUT in codes:
            reason = next(r for _, c, r in facts.rank_codes if c == BAD_INPUT)
            return "bad_input", reason or "a rank reported bad input"
        if PREEMPTED in codes:
            return "preempted", "ranks reported a committed checkpoint (exit 75); the launcher ended without a record"
        return "failed", f"launcher pid {gone[0].launcher_pid} on {host} ended without recording an outcome"
    if word in ("pending", "requeued"):
        return word, f"scheduler says {said}" + (f"; {facts.lost}" if facts.lost else "")
    timeout = watchdog.resolve_timeout(facts.hang_timeout, [b.step_time for b in beats])
    seen = [watchdog.Seen(b.rank, b.time or 0.0, b.step, b.host) for b in beats]
    verdict = watchdog.decide(seen, facts.now, timeout)
    if verdict.hung:
        return "hung", f"{verdict.reason}; stalled ranks {', '.join(map(str, verdict.stalled))}"
    if cancel:
        return "running", "cancel requested; waiting for the checkpoint and the stop"
    if not beats:
        return "running", "started; no rank reported progress yet"
    return "running", "making progress"


def _speaking(every: list[RankBeat], gone: frozenset[int], change: WorldChange | None) -> list[RankBeat]:
    """The beats that speak for the run: a rank lost while the others train on (live regroup) left a
    last beat that would hold `step` back and name the world it left. While some rank runs, the ranks
    still running speak; once none does (the run ended), the ranks that stepped past the last world
    change, else those that reached it (a run stopped while it regrouped: the lost rank's older beat
    showed `step: 1/192`, issue 52); when no rule leaves any beat, every beat."""
    running = [b for b in every if b.rank not in gone]
    if running:
        return running
    if change is not None:
        after = [b for b in every if b.step is not None and b.step > change.step]
        if after:
            return after
        reached = [b for b in every if b.step is not None and b.step >= change.step]
        if reached:  # ended in the regroup (a cancel then): the group that formed, not the rank it lost
            return reached
    return every


def _world_size(head: RankBeat | None, change: WorldChange | None, lost: bool, live: bool = False) -> int | None:
    """The ranks training now: a beat carries the WORLD_SIZE its process started with, so after a rank
    was lost and the others regrouped in place, or a live group grew in place (a node of `--nnodes
    MIN:MAX` that came late, a rank started again), the last world change says how many there are."""
    if (lost or live) and change is not None:
        return change.world_size
    return head.world_size if head else None


def _progress(beaten: int | None, ckpt: Checkpoint | None) -> int | None:
    """The run's step: its ranks' beats come every few steps (and a rank started again beats before
    its first step), so the newest verified checkpoint, committed after its step, may be ahead of them;
    the run got at least that far (status showed `step -` and a longer ETA beside `checkpoint: step 48`)."""
    if ckpt is None:
        return beaten
    return ckpt.step if beaten is None else max(beaten, ckpt.step)


def decide(facts: Facts) -> Status:
    """The run's state and the numbers `status` shows."""
    ckpt = facts.checkpoint
    ckpt_age = facts.now - ckpt.committed if ckpt and ckpt.committed is not None else None
    nodes = current_launch(facts.records)
    if not nodes:
        return Status(
            "unknown",
            "no job record in RUN_DIR/job/ (not a run dir, or started by a launcher that does not record jobs)",
            checkpoint=ckpt,
            checkpoint_age_s=ckpt_age,
            problems=tuple(facts.problems),
            world_change=facts.world_change,
        )
    launch = nodes[0].launch_id
    launches = {r.launch_id for r in nodes}
    every = [b for b in facts.beats if b.launch is None or b.launch in launches]
    beats = _speaking(every, facts.gone_ranks | left_behind(every, facts.world_change), facts.world_change)
    lost = len(beats) < len(every)
    quiet = {r.launch_id for r in nodes if r.outcome is None and _silent_launcher(r, every, beats)}
    active = [r for r in nodes if r.launch_id not in quiet] or nodes
    state, reason = _state(facts, active, beats, left=[r for r in nodes if r.launch_id in quiet])
    head = next((b for b in beats if b.rank == 0), beats[0] if beats else None)
    stepped = [b.step for b in beats if b.step is not None]
    step = _progress(min(stepped) if stepped else None, facts.checkpoint)
    total = head.total if head else None
    step_times = [b.step_time for b in beats if b.step_time]
    step_time = statistics.median(step_times) if step_times else None
    rates = [b.images_per_s for b in beats if b.images_per_s]
    running = state == "running"
    eta = (total - step) * step_time if running and total is not None and step is not None and step_time else None
    ages = [facts.now - b.time for b in beats if b.time is not None]
    node0 = min(nodes, key=lambda r: r.node_rank)
    return Status(
        state=state,
        reason=reason,
        scheduler=node0.scheduler,
        job_id=node0.job_id,
        launch_id=launch,
        hosts=tuple(r.host or "?" for r in nodes),
        started=min((r.started for r in nodes if r.started is not None), default=None),
        step=step,
        total=total,
        epoch=head.epoch if head else None,
        images_per_s=sum(rates) if rates and running else None,
        eta_s=max(eta, 0.0) if eta is not None else None,
        last_progress_age_s=min(ages) if ages else None,
        checkpoint=ckpt,
        checkpoint_age_s=ckpt_age,
        ranks=tuple(
            RankView(
                b.rank,
                b.host,
                b.step,
                facts.now - b.time if b.time is not None else None,
                b.pid,
                gone=lost and all(b is not k for k in beats),
            )
            for b in every
        ),
        cancel_requested=cancel_asked(facts, nodes),
        problems=(
            *facts.problems,
            *([facts.scheduler_state.note] if facts.scheduler_state and facts.scheduler_state.note else []),
        ),
        world_size=_world_size(head, facts.world_change, lost, live=bool(facts.regroups)),
        world_change=facts.world_change,
        regroups=facts.regroups,
    )
