"""The fault scenarios against the real local launcher on 2 netns nodes, with what each measured.

Each scenario starts `python -m launch.local --nnodes 2 ...` on both nodes (one worker each, CPU +
gloo, one shared run dir on the host filesystem as the shared storage), injects one fault at a
seeded step, lets the job recover (or fail and be rerun, as a scheduler would), and returns an
`Outcome`: exit codes, how long failure detection and recovery took, steps lost, and whether the
final model.pt equals the uninterrupted reference. The tests assert on it; faults/report.py prints it.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from faults import progress
from faults.inject import crash_during_checkpoint_write
from faults.job import Attempt
from faults.netns import Cluster, Node
from torchlaunch.core import checkpoint

CONFIG = "configs/smoke.yaml"
# 1024 synthetic images, global batch 128 -> 8 steps/epoch x 3 epochs = 24 steps of ~0.25 s on 2 cores.
SMALL = (
    "data.synthetic_train_size=1024",
    "data.synthetic_val_size=256",
    "train.log_every_steps=1",
    "checkpoint.every_steps=4",
    # The failure table of the restart road (ARCHITECTURE.md): live recovery's own netns faults are
    # tests/engines/faults/test_live_netns.py.
    "recovery.live=false",
)
TOTAL_STEPS = 24
PREEMPTED = 75
ATTEMPT_TIMEOUT_S = 240  # an uninterrupted attempt takes ~20 s; anything near this is a hang
PG_TIMEOUT_S = 10  # dist.timeout_s for the long-outage scenario: the least the config allows (MIN_TIMEOUT_S)
HANG_TIMEOUT_S = 15  # --hang-timeout for the cut-link scenario: the watchdog, not dist.timeout_s (300 s), ends it
CUT_BOUND_S = HANG_TIMEOUT_S + 60  # both launchers must have ended this long after the cut
SEED = os.environ.get("FAULTS_SEED", "1234")
_RESUMED = re.compile(r"resumed from \S+ at epoch \d+(?:/\d+)? step \d+(?:/\d+)? \(global step (\d+)\)")


def rng_for(name: str, seed: str = SEED) -> random.Random:
    """The fault points of scenario `name`: the same for the tests and faults/report.py."""
    return random.Random(f"{seed}:{name}")


def launcher_argv(
    node: Node,
    run_dir: Path,
    overrides: tuple[str, ...] = (),
    max_restarts: int = 0,
    rerun: bool = False,
    options: tuple[str, ...] = (),
) -> list[str]:
    """The real launcher for one node; a rerun passes RUN_DIR/config.yaml, as the contract says.
    `options` are more launcher options (e.g. --hang-timeout), kept by the rerun: the same command."""
    config = [f"{run_dir}/config.yaml"] if rerun else [CONFIG, f"run_dir={run_dir}", *SMALL, *overrides]
    return [
        sys.executable, "-m", "torchlaunch.agent", "--nnodes", "2", "--node-rank", str(node.index),
        "--master-addr", "node0", "--gpus", "1", "--device", "cpu", "--max-restarts", str(max_restarts),
        *options, "--config", *config,
    ]  # fmt: skip


class StepRecorder:
    """Samples the newest logged step every 50 ms in a thread: when training stalled and resumed."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            step = progress.last_step(self.run_dir)
            if not self.samples or self.samples[-1][1] != step:
                self.samples.append((time.monotonic(), step))
            self._stop.wait(progress.POLL_S)

    def first_beyond(self, step: int, after: float) -> float | None:
        """When a step beyond `step` was first seen at or after time `after`."""
        return next((t for t, s in self.samples if t >= after and s > step), None)

    def __enter__(self) -> StepRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class Outcome:
    """What one fault did to the job."""

    fault: str
    fault_step: int
    first_codes: list[int]
    failure_s: float | None = None  # fault -> last node exited, when the attempt failed
    recover_s: float | None = None  # fault -> training past the step where the fault hit
    resumed_from: int | None = None
    steps_lost: int = 0
    rerun_codes: list[int] | None = None
    final_step: int = -1
    model_path: Path | None = None
    model_equal: bool | None = None  # final model.pt torch.equal to the uninterrupted run's
    newest_checkpoint: int | None = None  # after a failed attempt, before the rerun
    newest_checkpoint_problem: str | None = None  # train.checkpoint.verify's reason, None when intact
    outcomes: list[str | None] | None = None  # each node's recorded launch outcome (RUN_DIR/job), e.g. "hung"
    stacks: dict[str, str] = field(default_factory=dict)  # hangs/<folder>/rank-N.txt -> how it was dumped
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        record = dataclasses.asdict(self)
        record["model_path"] = str(self.model_path) if self.model_path else None
        record["seed"] = SEED
        return record


def models_differ(path: Path, reference: Path) -> str | None:
    """None when both state_dicts hold the same tensors bit for bit; else what differs."""
    import torch

    got = torch.load(path, map_location="cpu", weights_only=True)
    want = torch.load(reference, map_location="cpu", weights_only=True)
    if got.keys() != want.keys():
        return f"different keys: {sorted(set(got) ^ set(want))}"
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    return f"tensors differ: {differ}" if differ else None


def resumed_steps(log_text: str) -> list[int]:
    return [int(m) for m in _RESUMED.findall(log_text)]


def _finish(
    cluster: Cluster,
    run_dir: Path,
    outcome: Outcome,
    attempt: Attempt,
    t_fault: float,
    rec: StepRecorder,
    at_fault: int,
    options: tuple[str, ...] = (),
) -> Outcome:
    """Shared tail: rerun a failed attempt (as a scheduler would), then measure resume, loss, recovery.

    `at_fault` is the step training had reached when the fault hit (for an outage: when the link came
    back); recovery means a step beyond it was logged again (by the rerun, if there was one).
    """
    final = attempt
    after = t_fault
    if outcome.first_codes != [0, 0]:
        outcome.failure_s = max(attempt.ended_at.values()) - t_fault
        at_fault = max((s for _, s in rec.samples), default=at_fault)  # in-flight steps count as done
        committed = progress.committed_checkpoints(run_dir)
        if committed:
            outcome.newest_checkpoint = committed[-1]
            outcome.newest_checkpoint_problem = checkpoint.verify(run_dir / "checkpoints" / f"step-{committed[-1]:09d}")
        else:
            outcome.newest_checkpoint_problem = "no committed checkpoint"
        final = Attempt.start(
            cluster,
            lambda n: launcher_argv(n, run_dir, rerun=True, options=options),
            run_dir,
            f"{attempt.log_prefix}-rerun",
        )
        after = final.started_at
        outcome.rerun_codes = final.wait(ATTEMPT_TIMEOUT_S)
    resumed = resumed_steps(Path(final.logs()[0]).read_text())
    if resumed:
        outcome.resumed_from = resumed[-1]
        outcome.steps_lost = max(0, at_fault - resumed[-1])
    recovered_at = rec.first_beyond(at_fault, after)
    outcome.recover_s = None if recovered_at is None else recovered_at - t_fault
    outcome.final_step = progress.last_step(run_dir)
    model = run_dir / "model.pt"
    outcome.model_path = model if model.is_file() else None
    return outcome


def _start(
    cluster: Cluster, workdir: Path, name: str, overrides=(), max_restarts=0, options: tuple[str, ...] = ()
) -> tuple[Path, Attempt]:
    run_dir = workdir / name / "run"
    run_dir.mkdir(parents=True)
    attempt = Attempt.start(
        cluster, lambda n: launcher_argv(n, run_dir, overrides, max_restarts, options=options), run_dir, f"{name}-first"
    )
    return run_dir, attempt


def reference(cluster: Cluster, workdir: Path) -> Outcome:
    """The uninterrupted run every fault's final model is compared with."""
    run_dir, attempt = _start(cluster, workdir, "reference")
    codes = attempt.wait(ATTEMPT_TIMEOUT_S)
    model = run_dir / "model.pt"
    return Outcome("none (reference)", 0, codes, final_step=progress.last_step(run_dir),
                   model_path=model if model.is_file() else None)  # fmt: skip


def preempt(cluster: Cluster, workdir: Path, rng: random.Random) -> Outcome:
    """SIGTERM to node 1's launcher (a scheduler preempting the job): both nodes exit 75, rerun resumes."""
    fault_step = rng.randint(6, TOTAL_STEPS - 6)
    run_dir, attempt = _start(cluster, workdir, "preempt")
    with StepRecorder(run_dir) as rec:
        progress.wait_for_step(run_dir, fault_step, ATTEMPT_TIMEOUT_S, attempt.dead_reason)
        t_fault, at_fault = time.monotonic(), progress.last_step(run_dir)
        cluster.signal_top(cluster.nodes[1], signal.SIGTERM)
        outcome = Outcome("SIGTERM to node 1's launcher (preemption)", fault_step, attempt.wait(ATTEMPT_TIMEOUT_S))
        return _finish(cluster, run_dir, outcome, attempt, t_fault, rec, at_fault)


def kill_worker(cluster: Cluster, workdir: Path, rng: random.Random) -> Outcome:
    """kill -9 of node 1's worker with --max-restarts 1: torchrun restarts the group, which resumes."""
    fault_step = rng.randint(6, TOTAL_STEPS - 6)
    run_dir, attempt = _start(cluster, workdir, "kill-worker", max_restarts=1)
    with StepRecorder(run_dir) as rec:
        progress.wait_for_step(run_dir, fault_step, ATTEMPT_TIMEOUT_S, attempt.dead_reason)
        t_fault, at_fault = time.monotonic(), progress.last_step(run_dir)
        victim = cluster.kill_worker(cluster.nodes[1])
        outcome = Outcome("kill -9 of one worker (--max-restarts 1)", fault_step, attempt.wait(ATTEMPT_TIMEOUT_S))
        outcome.notes.append(f"killed worker pid {victim} on node1")
        return _finish(cluster, run_dir, outcome, attempt, t_fault, rec, at_fault)


def kill_node(cluster: Cluster, workdir: Path, rng: random.Random, index: int = 1) -> Outcome:
    """kill -9 of every process of one node (agent and workers): the other fails bounded; rerun resumes."""
    fault_step = rng.randint(6, TOTAL_STEPS - 6)
    run_dir, attempt = _start(cluster, workdir, f"kill-node{index}")
    with StepRecorder(run_dir) as rec:
        progress.wait_for_step(run_dir, fault_step, ATTEMPT_TIMEOUT_S, attempt.dead_reason)
        t_fault, at_fault = time.monotonic(), progress.last_step(run_dir)
        killed = cluster.kill_node(cluster.nodes[index])
        outcome = Outcome(f"kill -9 of node {index} (agent + workers)", fault_step, attempt.wait(ATTEMPT_TIMEOUT_S))
        outcome.notes.append(f"killed {len(killed)} processes on node{index}")
        return _finish(cluster, run_dir, outcome, attempt, t_fault, rec, at_fault)


def link_down(
    cluster: Cluster, workdir: Path, rng: random.Random, seconds: float, pg_timeout_s: float | None
) -> Outcome:
    """node 1's link down for `seconds`; with dist.timeout_s=`pg_timeout_s` when given."""
    fault_step = rng.randint(6, TOTAL_STEPS - 8)
    overrides = (f"dist.timeout_s={pg_timeout_s}",) if pg_timeout_s else ()
    name = f"link-down-{seconds:g}s"
    run_dir, attempt = _start(cluster, workdir, name, overrides)
    with StepRecorder(run_dir) as rec:
        progress.wait_for_step(run_dir, fault_step, ATTEMPT_TIMEOUT_S, attempt.dead_reason)
        node = cluster.nodes[1]
        t_fault = time.monotonic()
        cluster.set_link(node, up=False)
        try:
            progress.wait_until(lambda: time.monotonic() - t_fault >= seconds, seconds + 5, f"{seconds} s of outage")
            stalled = progress.last_step(run_dir)
        finally:
            cluster.set_link(node, up=True)
        timeout = f", dist.timeout_s={pg_timeout_s}" if pg_timeout_s else ""
        outcome = Outcome(f"link down {seconds:g} s{timeout}", fault_step, attempt.wait(ATTEMPT_TIMEOUT_S))
        outcome.notes.append(f"step {stalled} when the link came back (fault at {fault_step})")
        return _finish(cluster, run_dir, outcome, attempt, t_fault, rec, stalled)


def hang_dumps(run_dir: Path) -> dict[str, str]:
    """Each rank stack file under RUN_DIR/hangs -> how the watchdog got it (faulthandler, py-spy, gone ...)."""
    found = {}
    for path in sorted((run_dir / "hangs").glob("*/rank-*.txt")):
        header = path.read_text(errors="replace").split("\n", 1)[0]
        how = re.search(r"\(([^)]*)\)$", header)
        found[str(path.relative_to(run_dir))] = how.group(1) if how else header
    return found


def launch_outcomes(run_dir: Path) -> list[str | None]:
    """Each node's recorded outcome of its latest launch (RUN_DIR/job/node-N.json), node 0 first."""
    from torchlaunch.jobs import record

    records, _ = record.read_all(run_dir)
    by_node = {r.node_rank: r.outcome for r in records}
    return [by_node.get(k) for k in range(2)]


def link_cut(cluster: Cluster, workdir: Path, rng: random.Random, hang_timeout_s: float = HANG_TIMEOUT_S) -> Outcome:
    """node 1's link cut for good: it comes back only once both launchers ended (then for the rerun).

    Nothing in the network ends this attempt: no RST ever arrives, and the default dist.timeout_s
    (300 s) is far off. What a user gets is `--hang-timeout S` on each node: its watchdog dumps the
    stacks and ends the ranks, and each launcher must then end on its own, with no store to reach.
    If one has not ended CUT_BOUND_S after the cut the link is restored anyway (so it can be seen
    whether it ends then); the measured failure_s shows it.
    """
    fault_step = rng.randint(6, TOTAL_STEPS - 8)
    options = ("--hang-timeout", f"{hang_timeout_s:g}")
    run_dir, attempt = _start(cluster, workdir, "link-cut", options=options)
    with StepRecorder(run_dir) as rec:
        progress.wait_for_step(run_dir, fault_step, ATTEMPT_TIMEOUT_S, attempt.dead_reason)
        node = cluster.nodes[1]
        t_fault = time.monotonic()
        cluster.set_link(node, up=False)

        def ended() -> bool:
            return all(code is not None for code in attempt.poll())

        try:
            try:
                progress.wait_until(ended, CUT_BOUND_S, "both launchers ending with the link cut")
                ended_while_cut = True
            except TimeoutError:
                ended_while_cut = False
            stalled = progress.last_step(run_dir)
        finally:
            cluster.set_link(node, up=True)
        outcome = Outcome(f"link cut for good, --hang-timeout {hang_timeout_s:g}", fault_step,
                          attempt.wait(ATTEMPT_TIMEOUT_S))  # fmt: skip
        outcome.outcomes = launch_outcomes(run_dir)
        outcome.stacks = hang_dumps(run_dir)
        if not ended_while_cut:
            outcome.notes.append(f"still running {CUT_BOUND_S} s after the cut: link restored")
        outcome.notes.append(f"step {stalled} at the end of the attempt (cut at {fault_step})")
        outcome.notes.append(f"recorded outcomes {outcome.outcomes}; {len(outcome.stacks)} rank stacks dumped")
        return _finish(cluster, run_dir, outcome, attempt, t_fault, rec, stalled, options)


def crash_mid_checkpoint(cluster: Cluster, workdir: Path, rng: random.Random) -> Outcome:
    """kill -9 of node 0 (rank 0 writes checkpoints) while a checkpoint write is provably in progress."""
    run_dir, attempt = _start(cluster, workdir, "crash-mid-checkpoint")
    with StepRecorder(run_dir) as rec:
        progress.wait_until(lambda: len(progress.committed_checkpoints(run_dir)) >= 1, ATTEMPT_TIMEOUT_S,
                            "a first committed checkpoint", attempt.dead_reason)  # fmt: skip
        crash = crash_during_checkpoint_write(cluster, cluster.nodes[0], run_dir, timeout_s=ATTEMPT_TIMEOUT_S)
        t_fault, at_fault = time.monotonic(), progress.last_step(run_dir)
        newest = progress.committed_checkpoints(run_dir)[-1]
        outcome = Outcome("kill -9 of node 0 mid checkpoint write", progress.last_step(run_dir),
                          attempt.wait(ATTEMPT_TIMEOUT_S))  # fmt: skip
        outcome.notes.append(f"caught {crash.caught.describe()} after {crash.attempts} write events")
        outcome.notes.append(f"newest committed checkpoint at the crash: step {newest}")
        return _finish(cluster, run_dir, outcome, attempt, t_fault, rec, at_fault)


ALL: dict[str, Callable[[Cluster, Path, random.Random], Outcome]] = {
    "preempt": preempt,
    "kill-worker": kill_worker,
    "kill-node": kill_node,
    "link-down-short": lambda c, w, r: link_down(c, w, r, seconds=3, pg_timeout_s=None),
    "link-down-long": lambda c, w, r: link_down(c, w, r, seconds=3 * PG_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S),
    "link-cut": link_cut,
    "crash-mid-checkpoint": crash_mid_checkpoint,
}
