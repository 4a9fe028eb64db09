"""What runs inside each Slurm task: the picklable callable submitit starts on every rank.

It exports the env contract (submitit's TorchDistributedEnvironment), runs the program in-process
through torchlaunch.runner, and turns the program's exit code into Slurm's next step: rank 0 requeues
a preempted or timed-out job once (`scontrol requeue`), a hang requeues through the node's watchdog,
a cancel or bad input ends the job with its code recorded as data for `launch.slurm --wait`. Rank
side: it imports nothing from torchlaunch.launch (the submitting side renders and submits it).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from torchlaunch import compat, contract, roads, rundir, runlock, status
from torchlaunch import runner as program_mod
from torchlaunch.backends.slurm import cluster, successor
from torchlaunch.backends.slurm import live as slurm_live
from torchlaunch.backends.slurm.cluster import controller_state, job_state
from torchlaunch.backends.slurm.killed import killed_before
from torchlaunch.backends.slurm.result import result_path
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BAD_INPUT, CANCELLED, FAILURE, OK, PREEMPTED
from torchlaunch.jobs import ranklog, record, watchdog
from torchlaunch.jobs.launcher import Operation, prepare_rank
from torchlaunch.jobs.lost import lost_line, steps_lost
from torchlaunch.stop_signals import STOP_SIGNALS, hold_early_stops

DEFAULT_MAX_TIMEOUTS = 3
SLURM_SIGNAL_SLACK_S = 65
"""Slurm may send the --signal up to 60 s before the requested lead time (its timer resolution)."""


class WorkerExit(RuntimeError):
    """Raised in a task so submitit records a failure (and Slurm does not requeue): carries the code.
    submitit keeps only the traceback's text; the code reaches `--wait` as data, through the task's
    result record (write_result), never parsed back out of this message."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(f"worker exit code {code}: {why}")
        self.code = code
        self.why = why
        write_result(code, why)


def left_out() -> bool:
    """Whether this task's live group was fenced (live/fence.py): its exit 2 is then not the job's bad
    input, and its node's outcome not the run's. Never imported here: never fenced."""
    fence = sys.modules.get("torchlaunch.live.fence")
    return fence is not None and fence.left_out()


def write_result(code: int, why: str) -> None:
    """In a task of a submitit job: record its final code and reason for `--wait` (exit_status), and the
    allocation it ended in (`launch`: a live job's batch script counts only this allocation's records,
    backends.slurm.live.verdict), and `left_out` when this task's live group was fenced (live/fence.py:
    its exit 2 is then not the job's bad input). Outside one (a unit test calling a task's method), or when the folder
    cannot be written, nothing."""
    try:
        import submitit

        env = submitit.JobEnvironment()
        launch = f"{contract.get(contract.SLURM_JOB_ID, '0')}-{contract.get(contract.SLURM_RESTART_COUNT) or 0}"
        record_ = {"code": code, "why": why, "launch": launch, **({"left_out": True} if left_out() else {})}
        rundir.write_json(result_path(env.paths.folder, str(env.job_id), env.global_rank), record_)
    except Exception:  # noqa: BLE001 - the result record is a courtesy to --wait: the job's end comes first
        pass


def is_timeout(elapsed_s: float, time_min: int, signal_delay_s: int) -> bool:
    """A stop counts as a timeout only inside the allocation's final signal window.

    Slurm sends the time-limit signal signal_delay_s (up to 60 s more) before the end; a signal
    earlier than that is a preemption and must not spend the timeout budget. submitit's own rule,
    run time >= min(0.8 T, T - 10 min), calls every signal in a job of T <= 10 min a timeout.
    """
    return elapsed_s >= time_min * 60 - signal_delay_s - SLURM_SIGNAL_SLACK_S


def leave(code: int) -> NoReturn:
    """Exit now with `code`, output flushed, without a submitit result and without running C++
    static destructors (see the OK path in SlurmTask.__call__)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # srun ended the step's I/O (a cancel): the code still goes out
            pass
    os._exit(code)


def say(line: str) -> None:
    """Print one line of this task's end. On a cancel srun may have ended the step's I/O already
    (`srun: forcing job termination`): the print meets a broken pipe (seen on the dev cluster:
    BrokenPipeError, re-raised by submitit, exit 1). The line then goes straight to this task's own
    output file, which srun no longer writes: appended, never through a link, never created."""
    try:
        print(line, flush=True)
        return
    except (OSError, ValueError):
        pass
    try:
        import submitit

        out = Path(submitit.JobEnvironment().paths.stdout)
        folder = rundir.open_folder(out.parent)
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(out.name, flags, dir_fd=folder)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.write(fd, (line + "\n").encode("utf-8", "replace"))
            finally:
                os.close(fd)
        finally:
            os.close(folder)
    except Exception:  # noqa: BLE001 - the line is a courtesy: the result record holds it and the code goes out
        pass


LAUNCH_CANCEL = "python -m launch cancel"
SCANCEL = "scancel"
"""How a cancel reached the task: the run's cancel mark (record.cancel_requested), or Slurm's word alone."""


def end_cancelled(job_id: str, how: str, program_code: int = PREEMPTED) -> NoReturn:
    """End this task of a cancelled job: one line, its code recorded for `--wait`, exit CANCELLED (3).

    A cancel is the user's clean stop, not a failure: raising WorkerExit here made submitit print a
    20-line traceback of its own re-raise and exit 1 (srun: "task 0: Exited with exit code 1"), for a
    job whose ranks had checkpointed as asked. Leaving without a submitit result is safe: `--wait`
    reads Slurm's CANCELLED, or this task's result record when the job ended FAILED first."""
    if program_code in (PREEMPTED, CANCELLED):
        what = "its progress is checkpointed: submit the same command again to resume"
    else:  # the cancel met a program that ended on its own (a failure): claim no checkpoint it did not say
        what = f"its program ended with exit {program_code}; a new submission resumes from the newest checkpoint"
    why = f"job {job_id} was cancelled ({how}), not requeued; {what}"
    say(f"slurm task: {why}")
    write_result(CANCELLED, why)
    leave(CANCELLED)


def scancelled(job_id: str, live_state: str) -> bool:
    """Whether a job that is no longer RUNNING at its stop was ended by scancel, not by its hard time
    limit: squeue says COMPLETING for both while the steps end, so accounting's word decides."""
    return live_state.split()[:1] == ["CANCELLED"] or job_state(job_id).split()[:1] == ["CANCELLED"]


def requeues(rank: int, first_below_minimum: bool) -> bool:
    """Whether this task requeues the job after a committed checkpoint (pure): rank 0 of the launch, or
    the live group's rank 0 when the group stopped below --nodes MIN-MAX's minimum (the launch's rank 0
    may be the process that was lost). Exactly one task: a live group's rank 0 is the launch's rank 0
    whenever that one is alive (members sort by launch rank)."""
    return rank == 0 or first_below_minimum


MASTER_PORTS = (20000, 32767)
"""Where rank 0's store listens: below Linux's default ephemeral range (32768-60999), which submitit's
own choice (20000-60000) mostly falls in; a port there can be taken by any outgoing connection's
local end on the node (seen: rank 0 failed with EADDRINUSE and the other ranks waited 300 s for it)."""


def master_port(launch_id: str) -> int:
    """rank 0's store port for this allocation: the same on every task (a function of the job id and
    the requeue count, which all of them see), and a different one after a requeue, so a port that
    stays taken on the node costs one attempt, not every attempt."""
    low, high = MASTER_PORTS
    digest = hashlib.blake2b(launch_id.encode(), digest_size=4).digest()
    return low + int.from_bytes(digest, "big") % (high - low + 1)


@dataclass
class SlurmTask:
    """The picklable callable submitit runs in every task; its fields survive requeues."""

    argv: list[str]
    time_min: int
    signal_delay_s: int
    max_timeouts: int = DEFAULT_MAX_TIMEOUTS
    cwd: str | None = None
    """A user's program runs from here (the submission directory)."""
    run_dir: str | None = None
    """The job's run dir: job record, heartbeats, rank logs; rank 0 releases its runlock when the job is done."""
    command: list[str] = field(default_factory=list)
    """The submitting command line, for the job record (`python -m launch status`)."""
    hang_timeout: float | None = None
    """Seconds without progress before the node's watchdog dumps the ranks and requeues (None: automatic, 0: off)."""
    console_env: dict[str, str] = field(default_factory=dict)
    """ranklog.Console's environment for the ranks (their console is the task's output file)."""
    lighthouse: str = ""
    """Live recovery (recovery.live): the membership service's address; '' when the job is not live."""
    heartbeat_timeout_ms: int = 1000
    """recovery.heartbeat_timeout_s of a live job whose nodes place the service (slurm_live.PLACED)."""
    live_minimum: dict[str, str] = field(default_factory=dict)
    """A live job on --nodes MIN-MAX: MIN for its ranks (backends.slurm.live.minimum_env); below it they
    checkpoint and exit 75, which rank 0 requeues as a preemption."""
    max_hang_requeues: int = 1
    timeouts: int = 0
    preemptions: int = 0
    hangs: int = 0
    history: list[str] = field(default_factory=list)

    def __call__(self) -> int:
        hold_early_stops()  # first: submitit's SIGUSR2 handler would requeue a job cancelled while it starts
        import submitit

        started = time.time()
        # One thread per allotted CPU: torch would otherwise start a thread per core in every task.
        os.environ.setdefault("OMP_NUM_THREADS", contract.get(contract.SLURM_CPUS_PER_TASK, "1") or "1")
        if contract.MASTER_PORT not in os.environ:  # a port the user exported is theirs to choose
            os.environ[contract.MASTER_PORT] = str(master_port(self.launch_id()))
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        rank = dist_env.rank
        print(
            f"slurm task: rank {rank}/{dist_env.world_size} local {dist_env.local_rank} "
            f"master {dist_env.master_addr}:{dist_env.master_port} "
            f"(timeouts {self.timeouts}/{self.max_timeouts}, preemptions {self.preemptions}) on {socket.gethostname()}",
            flush=True,
        )
        end_service = self._live_env(dist_env.local_rank, dist_env.local_world_size, dist_env.master_addr)
        op = self._operation(dist_env.local_rank, dist_env.local_world_size)
        if self.cwd:
            os.chdir(self.cwd)
        try:
            code = program = program_mod.main(list(self.argv))  # the one runner, as in every launcher
        finally:
            end_service()  # this node's part of a placed service: its lease released, its Lighthouse ended
        # The program restored submitit's handlers; from here on a late USR2/TERM must not make
        # submitit requeue a second time.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        lost = self._lost(rank, code)
        if lost:
            say(f"slurm task: {lost}")
        if op is not None:  # a task left out of the live group (fenced) records no outcome: it was lost to the run
            code = op.finish(FAILURE if lost else code, lost, recorded=not left_out())
        if self.lighthouse:  # every task's code, for the batch script's verdict (a lost task leaves none)
            write_result(code, program_mod.last_reason or "")
        if code == OK:
            if rank == 0 and self.run_dir:
                runlock.release_for_job(self.run_dir, "slurm", contract.get(contract.SLURM_JOB_ID, "") or "")
            # submitit writes the result after we return; then skip C++ static destructors, which
            # sometimes abort a rank at exit on torch 2.14.1 ("terminate called without an active
            # exception") and would turn a finished job into FAILED.
            atexit.register(leave, OK)
            return OK
        if code == CANCELLED:
            end_cancelled(contract.get(contract.SLURM_JOB_ID, "") or "", LAUNCH_CANCEL, FAILURE if lost else program)
        if code == PREEMPTED or lost:
            self._requeue(rank, time.time() - started, lost)
        if code == BAD_INPUT:
            raise WorkerExit(code, "bad input, not requeued; fix the config and submit again")
        raise WorkerExit(code, "worker failed; see this task's log")

    def _live_env(self, local_rank: int, local_world_size: int, master_addr: str) -> Callable[[], None]:
        """A live task's env (backends.slurm.live.task_env); with the service PLACED, this node's part
        of it started first (place_service). Returns what ends that part (nothing to end otherwise)."""
        if not self.lighthouse:
            return lambda: None
        nnodes = int(contract.get(contract.SLURM_NNODES, "1") or "1")
        placed = self.lighthouse == slurm_live.PLACED
        host = slurm_live.node_store_host("" if placed else self.lighthouse, nnodes, master_addr)
        address, end = self.lighthouse, lambda: None
        if placed and self.run_dir:
            hb_ms = getattr(self, "heartbeat_timeout_ms", 1000)
            address, end = slurm_live.place_service(self.run_dir, hb_ms, local_rank, local_world_size, host)
        os.environ.update(slurm_live.task_env(address, host, getattr(self, "live_minimum", {}), placed=placed))
        return end

    def launch_id(self) -> str:
        """This allocation of the job: the same on every node, new after each requeue."""
        return f"{contract.get(contract.SLURM_JOB_ID, '0')}-{contract.get(contract.SLURM_RESTART_COUNT) or 0}"

    def _lost(self, rank: int, code: int) -> str:
        """Rank 0's line for a stop of the built-in trainer that ended 75 while its ranks had trained past
        the checkpoint it committed (or past the newest one, when it said none), as launch.local says
        it; '' otherwise. Only the built-in trainer's run dir holds the checkpoints this counts from."""
        builtin = self.argv[:2] == ["-m", program_mod.BUILTIN_WORKER]
        if code != PREEMPTED or rank != 0 or not self.run_dir or not builtin:
            return ""
        lost = steps_lost(Path(self.run_dir), self.launch_id(), status.committed_step())
        return lost_line(lost, then="a rerun resumes from there") if lost[0] else ""

    def _operation(self, local_rank: int, local_world_size: int) -> Operation | None:
        """Rank env and per-rank logs for this task; the node's local rank 0 also records the node's
        launch and runs its hang watchdog. None without a run dir (nothing to record into)."""
        if not self.run_dir:
            return None
        job = contract.get(contract.SLURM_JOB_ID, "") or ""
        node_rank = int(contract.get(contract.SLURM_NODEID, "0") or "0")
        op = Operation(
            self.run_dir,
            scheduler="slurm",
            command=self.command or list(self.argv),
            launch_id=self.launch_id(),
            job_id=contract.get(contract.SLURM_JOB_ID),
            node_rank=node_rank,
            nnodes=int(contract.get(contract.SLURM_NNODES, "1") or "1"),
            local_ranks=local_world_size,
            hang_timeout=self.hang_timeout,
            console=ranklog.Console.from_env(self.console_env),
            # A live job's successor (backends.slurm.successor), for `status` and `cancel`.
            extra=successor.record_extra(self.run_dir, job) if self.lighthouse and whole(job, 20) is not None else None,
        )
        if local_rank == 0 and node_rank == 0:
            # Before this allocation replaces that one's record, and this rank's beat (prepare_rank's first
            # heartbeat): the other tasks start at once, so their beats may be this allocation's already.
            killed = killed_before(self.run_dir, job, self.launch_id())
            if killed:
                say(f"slurm task: {killed}")
        os.environ.update(op.rank_env())
        prepare_rank()
        if local_rank != 0:
            return None
        op.start(on_hang=lambda verdict, folder, beats: self._on_hang(verdict, folder, beats, op))
        return op

    def _on_hang(self, verdict: Any, folder: Path, beats: list[Any], op: Operation) -> None:
        """The watchdog's thread, after the stacks are in `folder`: requeue the job (the ranks resume
        from the newest checkpoint) up to max_hang_requeues times, then end the hung ranks for good."""
        job_id = contract.get(contract.SLURM_JOB_ID, "") or ""
        print(f"slurm task: hang ({verdict.reason}); stacks in {folder}", file=sys.stderr, flush=True)
        if self.hangs < self.max_hang_requeues and not record.cancel_requested(self.run_dir or "", self.launch_id()):
            self.hangs += 1
            self.history.append(f"hang after {verdict.reason}")
            self._save_for_requeue()
            requeue = cluster.requeue(job_id)
            print(
                f"slurm task: hang: job {job_id} requeued ({self.hangs}/{self.max_hang_requeues}) "
                f"{requeue.err.strip() if requeue is not None else 'scontrol requeue gave no answer'}",
                file=sys.stderr,
                flush=True,
            )
            if op.dog is not None:
                # The job is ending: no second dump of ranks Slurm is killing. (Watchdog.stop() joins
                # the watchdog's thread, which is this one: only its stop event is set.)
                op.dog._stop.set()
            return
        print(
            f"slurm task: hang: not requeued again; ending the hung ranks of job {job_id}", file=sys.stderr, flush=True
        )
        watchdog.kill_ranks(beats)

    def _requeue(self, rank: int, elapsed_s: float, lost: str = "") -> None:
        """Rank 0 requeues once; every rank leaves without a result so submitit waits for the rerun. A live
        group that fell below --nodes MIN-MAX's minimum stopped by itself: neither a timeout nor a
        preemption, and said as such. A cancelled job is never requeued: every task ends with one line
        and exit 3 (end_cancelled). A stop that `lost` steps (rank 0's line, already said) is requeued
        the same way, and its task exits 1 (README's exit codes), claiming no checkpoint."""
        program = FAILURE if lost else PREEMPTED
        committed = lost or "a checkpoint is committed"
        below_minimum = roads.get("live").minimum  # what a live rank recorded when its group shrank
        below = bool(below_minimum.last_stop)
        timed_out = not below and is_timeout(elapsed_s, self.time_min, self.signal_delay_s)
        job_id = contract.get(contract.SLURM_JOB_ID, "") or ""
        if self.run_dir and record.cancel_requested(self.run_dir, self.launch_id()):
            end_cancelled(job_id, LAUNCH_CANCEL, program)  # every task: the mark is a file, not a question to slurmctld
        if not requeues(rank, below_minimum.first_at_stop):
            say("slurm task: checkpoint committed; rank 0 requeues the job unless it is ending (scancel, time limit)")
            leave(PREEMPTED)
        job_id = contract.require(contract.SLURM_JOB_ID)
        live_state = controller_state(job_id)
        if live_state != "RUNNING" and scancelled(job_id, live_state):
            end_cancelled(job_id, SCANCEL, program)
        if live_state != "RUNNING":
            # scancel (or the hard time limit) got here first: the job is ending for good.
            raise WorkerExit(
                program, f"job {job_id} is {live_state}, not requeued; {committed}: submit the same command again"
            )
        if timed_out and self.timeouts >= self.max_timeouts:
            raise WorkerExit(
                program,
                f"timed out {self.timeouts + 1} times (limit {self.max_timeouts}); {committed}: "
                "submit the same command again",
            )
        self.timeouts += timed_out
        self.preemptions += not timed_out and not below
        kind = "below the live minimum" if below else "timeout" if timed_out else "preemption"
        self.history.append(f"{kind} after {elapsed_s:.0f}s")
        self._save_for_requeue()
        # Needed for preemption too: Slurm requeues a preempted job only if it is still running when
        # GraceTime ends; a job whose tasks exit earlier would just complete. Requeueing now also
        # frees the nodes at once. If Slurm's own requeue won the race, ours is refused: fine.
        # Leaving without a result pickle is what keeps submitit waiting for the next allocation.
        requeue = cluster.requeue(job_id)
        if requeue is None or requeue.code != 0:
            said = requeue.err.strip() if requeue is not None else "no answer"
            print(f"slurm task: scontrol requeue: {said} (state {job_state(job_id)})", flush=True)
        said = program_mod.last_reason
        what = said if program_mod.stopped_by_runner(said) else "steps lost" if lost else "checkpoint committed"
        print(
            f"slurm task: {kind}: {what}, job {job_id} requeued "
            f"(timeouts {self.timeouts}/{self.max_timeouts}, preemptions {self.preemptions})",
            flush=True,
        )
        leave(program)

    def _save_for_requeue(self) -> None:
        """Rewrite the submitted pickle so the next allocation sees the updated counters."""
        import submitit

        paths = submitit.JobEnvironment().paths
        delayed = compat.delayed_submission(self)
        delayed.set_timeout(self.time_min, self.max_timeouts - self.timeouts)
        with compat.temporary_save_path(paths.submitted_pickle) as tmp:
            delayed.dump(tmp)

    def checkpoint(self) -> Any:
        """submitit calls this only when its own USR2 handler runs: a signal before the worker
        installed its handlers. Nothing trained since the last checkpoint, so requeue as is."""
        return compat.delayed_submission(self)
