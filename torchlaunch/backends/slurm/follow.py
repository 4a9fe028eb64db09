"""Following a submitted Slurm job to its end (`launch.slurm --wait`): rank 0's output as it is written,
the job's final state from every source, a live job's successor when its batch host was lost, and the
exit status (from Slurm's final state and the code task 0 recorded as data), with the first failing
task's stderr tail when it failed.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch.backends.slurm import successor as slurm_successor
from torchlaunch.backends.slurm.cluster import job_state, scontrol_state
from torchlaunch.backends.slurm.result import read_result
from torchlaunch.backends.slurm.states import LIVE_STATES, TERMINAL_STATES
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BAD_INPUT, CANCELLED, FAILURE, OK, PREEMPTED
from torchlaunch.jobs import ranklog

NODE_FAIL_REQUEUE_S = 60.0
"""How long --wait keeps following a job that ended NODE_FAIL for its requeue to show (PENDING): every
source says NODE_FAIL for a moment before slurmctld requeues a --requeue job (measured: under 1 s)."""
STATE_SOURCES: tuple[Any, ...] = (job_state, scontrol_state)
"""Asked in order on every poll of `--wait`; the first that names a terminal state ends it."""


def rank0_log(job: Any) -> Path:
    return Path(job.paths.folder) / f"{job.job_id}_0_log.out"


LOST_AFTER_S = 300.0
"""--wait gives up on a job that no source (accounting, slurmctld) knows for this long: a controller
restarted under a just-submitted job can purge it, and polling it would never end."""


class _StopFollowing(Exception):
    """SIGTERM reached `launch.slurm --wait`: stop following, like Ctrl-C."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopFollowing


def follow(job: Any, poll_s: float = 1.0, out: Any = None, err: Any = None, lost_after_s: float = LOST_AFTER_S) -> int:
    """Stream rank 0's stdout and stderr until any source says the job is over; return the job's exit
    status. Ctrl-C or SIGTERM stop the following only, in one line: the job keeps running. A job that
    no source knows for `lost_after_s` is one line and exit 1."""
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        return _follow(job, poll_s, out or sys.stdout, err or sys.stderr, lost_after_s)
    except (KeyboardInterrupt, _StopFollowing) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM"
        print(
            f"launch: {name}: stopped following job {job.job_id}; the job keeps running "
            f"(cancel it with: scancel {job.job_id})",
            file=err or sys.stderr,
            flush=True,
        )
        return 128 + (signal.SIGINT if name == "SIGINT" else signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _follow(job: Any, poll_s: float, out: Any, err: Any, lost_after_s: float) -> int:
    streams = [(rank0_log(job), out), (rank0_log(job).with_suffix(".err"), err)]
    offsets = [0, 0]
    known_at = time.monotonic()
    node_failed_at: float | None = None
    while True:
        said = [source(job.job_id) for source in STATE_SOURCES]
        state = next((one for one in said if one.split()[0] in TERMINAL_STATES), None)
        if state is not None and any(one.split()[0] in LIVE_STATES for one in said):
            state = None  # requeued after a node failure: accounting's NODE_FAIL is the failed allocation's
        after = successor_of(job, state) if state is not None else None
        if after is not None:  # a live job whose batch host was lost: its successor carries the run on
            for i, (path, stream) in enumerate(streams):
                offsets[i] = _copy_new(path, stream, offsets[i])
            print(
                f"launch: job {job.job_id} lost its batch host ({state}); following its successor job "
                f"{after.job_id}, which resumes the run from the newest checkpoint",
                file=err,
                flush=True,
            )
            job, known_at, node_failed_at = after, time.monotonic(), None
            streams, offsets = [(rank0_log(job), out), (rank0_log(job).with_suffix(".err"), err)], [0, 0]
            continue
        if state is not None and state.split()[0] == "NODE_FAIL":
            node_failed_at = node_failed_at or time.monotonic()
            if time.monotonic() - node_failed_at < NODE_FAIL_REQUEUE_S:
                state = None  # Slurm requeues a --requeue job after a node failure: NODE_FAIL comes first
        for i, (path, stream) in enumerate(streams):
            offsets[i] = _copy_new(path, stream, offsets[i])
        if state is not None:
            break
        if any(one != "UNKNOWN" for one in said):
            known_at = time.monotonic()
        elif time.monotonic() - known_at > lost_after_s:
            print(
                f"launch: job {job.job_id} is unknown to sacct and scontrol for {lost_after_s:.0f} s (lost, e.g. "
                "purged by a controller restart); stopped waiting; submit the same command again",
                file=err,
                flush=True,
            )
            return FAILURE
        time.sleep(poll_s)  # polling the scheduler: there is nothing to wait on
    return exit_status(job, state)


def _copy_new(path: Path, stream: Any, offset: int) -> int:
    """What `path` gained since `offset`, written to `stream`; the new offset."""
    if not path.exists():
        return offset
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        chunk = f.read()
        offset = f.tell()
    stream.write(chunk)
    stream.flush()
    return offset


@dataclass(frozen=True)
class Followed:
    """A job `--wait` follows that it did not submit itself (a live job's successor): what `follow`,
    `rank0_log` and `exit_status` read of submitit's Job."""

    job_id: str
    paths: Any


def successor_of(job: Any, state: str) -> Followed | None:
    """The successor to follow when `job` ended `state` because its batch host was lost (the successor's
    own rule, backends.slurm.successor.lost); None otherwise."""
    folder = Path(job.paths.folder)  # RUN_DIR/slurm/JOB
    run_dir, job_id = folder.parent.parent, str(job.job_id)
    chain = slurm_successor.read(run_dir, job_id)
    if chain is None or chain.successor is None:
        return None
    went, _ = slurm_successor.lost(chain, state, slurm_successor.cancel_asked(run_dir, job_id))
    if not went:
        return None
    from submitit.core.utils import JobPaths

    return Followed(chain.successor, JobPaths(folder.parent / "%j", job_id=chain.successor))


TAIL_LINES = 20
SUBMITIT_ERROR = "Submitted job triggered an exception"
"""submitit's line before its traceback of the task's exception (the runner already printed the program's)."""
TASK_LINE = re.compile(r"^slurm task: rank (\d+)/\d+ .* on (\S+)$", re.MULTILINE | re.ASCII)


@dataclass(frozen=True)
class TaskFailure:
    task: int
    rank: int | None
    host: str | None
    err: Path
    tail: list[str]


FAILED_MARKERS = ("Traceback (most recent call last)", "worker exit code")


def failing_tasks(folder: str | Path, job_id: str) -> list[TaskFailure]:
    """The tasks of `job_id` whose output shows a failure (a traceback or a worker exit), first failure
    first (by when it was last written). A task's stderr file is read first; its rank's own log
    (RUN_DIR/logs/rank-N.log) when the stderr file has no failure, as when --console-ranks kept the
    rank's output off its task files."""
    failures = []
    for err in Path(folder).glob(f"{job_id}_*_log.err"):
        task = err.name[len(job_id) + 1 :].split("_", 1)[0]
        if whole(task, 9) is None:
            continue
        out = err.with_name(err.name[: -len(".err")] + ".out")
        seen = TASK_LINE.findall(_read(out))
        rank, host = (int(seen[-1][0]), seen[-1][1]) if seen else (None, None)
        sources = [(err, [line for line in _read(err).splitlines() if line.strip()])]
        if rank is not None:
            log = ranklog.log_path(Path(folder).parent.parent, rank)  # the folder is RUN_DIR/slurm/JOB
            entries, _ = ranklog.read_lines(log, rank)
            sources.append((log, [e[3].decode("utf-8", "replace") for e in entries if e[3].strip()]))
        for path, lines in sources:
            if not any(marker in line for line in lines for marker in FAILED_MARKERS):
                continue
            ours = [i for i, line in enumerate(lines) if SUBMITIT_ERROR in line]
            if ours and ours[-1] > 0:
                lines = lines[: ours[-1]]  # the program's own words, not submitit's re-raise of our WorkerExit
            try:
                mtime = path.stat().st_mtime
            except OSError:
                mtime = 0.0
            failures.append((mtime, int(task), TaskFailure(int(task), rank, host, path, lines[-TAIL_LINES:])))
            break
    return [failure for _, _, failure in sorted(failures, key=lambda f: (f[0], f[1]))]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def failure_report(folder: str | Path, job_id: str, state: str) -> str:
    """What `--wait` prints for a failed job: the first failing task's stderr tail (rank and node), then
    where all logs are; one line when no task's stderr shows a failure."""
    failures = failing_tasks(folder, job_id)
    if not failures:
        return f"job {job_id} ended {state}; see the logs in {folder}"
    lines = [f"job {job_id} ended {state}"]
    if failures:
        first = failures[0]
        who = f"rank {first.rank}" if first.rank is not None else f"task {first.task}"
        where = f" on {first.host}" if first.host else ""
        others = f" ({len(failures) - 1} more task(s) failed)" if len(failures) > 1 else ""
        lines.append(f"first failing: {who}{where}{others}; last lines of {first.err}:")
        lines += [f"  {line}" for line in first.tail]
    lines.append(f"all logs: {folder}")
    return "\n".join(lines)


def exit_status(job: Any, state: str) -> int:
    """The job's exit code (scheduler_code) from the final Slurm state and the code task 0
    recorded as data (read_result); one line on stderr unless it finished."""
    kind = state.split()[0]
    result, why = read_result(job.paths.folder, str(job.job_id)) if kind == "FAILED" else (None, "")
    code = scheduler_code(state, result)
    if code == OK:
        return OK
    if kind == "CANCELLED":
        print(f"job {job.job_id} was cancelled ({state}); its newest checkpoint is in the run dir", file=sys.stderr)
    elif code != FAILURE:
        print(f"worker exit code {code}: {why}", file=sys.stderr)
    else:
        print(failure_report(job.paths.folder, str(job.job_id), state), file=sys.stderr)
    return code


def scheduler_code(state: str, result: int | None) -> int:
    """A job's exit code from the scheduler's final state word (Slurm's COMPLETED, CANCELLED, FAILED,
    TIMEOUT...) and, where the job left one, the code its task recorded as data."""
    kind = state.split()[0] if state.split() else ""
    if kind == "COMPLETED":
        return OK
    if kind == "CANCELLED":
        return CANCELLED
    if result in (BAD_INPUT, PREEMPTED, CANCELLED):
        return result
    return FAILURE
