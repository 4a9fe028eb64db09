"""The Slurm backend: what a running job needs from the cluster (squeue, sacct, scontrol, scancel).

Every query is bounded by a timeout and answers "cannot say" (None, UNKNOWN, or alive) when the
tool is missing or fails: a machine without the Slurm tools must never conclude that a job is over
and take over its run dir. The submission artefact (the submitit executor) and the in-task runtime
(requeue) is torchlaunch.backends.slurm.task's; the sbatch artefact and the command line are
torchlaunch.backends.slurm.launch's. What lives here talks to the cluster: the state queries, the partitions
sbatch would check, the submission through submitit, and following a job to its end (`--wait`: its
output, its final state, the code its task 0 recorded as data).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch import backends, contract, exit_codes, rundir
from torchlaunch.backends import Detected, JobState, LaunchRecord, Step
from torchlaunch.backends.slurm import proof as slurm_proof
from torchlaunch.backends.slurm import successor as slurm_successor
from torchlaunch.base import files
from torchlaunch.base.procs import tool_output
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import FAILURE, OK, BadInput
from torchlaunch.jobs import ranklog

SLURM_ID = re.compile(r"^\d+(_\d+)?(\+\d+)?$", re.ASCII)
"""A job id as Slurm writes it (array and heterogeneous forms): only such a string reaches a command."""
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def have(tool: str) -> bool:
    """Whether this machine has the Slurm command `tool` (a login node has; a laptop has not)."""
    return shutil.which(tool) is not None


def controller_state(job_id: str) -> str:
    """The job's live state from slurmctld: RUNNING while a timeout or preemption signal is pending,
    COMPLETING once scancel or the hard time limit is ending it."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    return out.strip() or "UNKNOWN"


def job_state(job_id: str) -> str:
    """The job's state from accounting (first word: "CANCELLED by 0" -> "CANCELLED")."""
    try:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else "UNKNOWN"


def scontrol_state(job_id: str) -> str:
    """The job's state from `scontrol show job` (slurmctld's memory of finished jobs, MinJobAge), which
    knows a job's end even where accounting has no record of it."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    for word in out.split():
        if word.startswith("JobState="):
            return word.partition("=")[2] or "UNKNOWN"
    return "UNKNOWN"


LIVE_STATES = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "CONFIGURING", "RUNNING", "SUSPENDED")
"""States in which a job goes on: a source saying one of these outweighs another's terminal state (after a
node failure, sacct's last record is the failed allocation's NODE_FAIL while slurmctld has requeued it)."""
NODE_FAIL_REQUEUE_S = 60.0
"""How long --wait keeps following a job that ended NODE_FAIL for its requeue to show (PENDING): every
source says NODE_FAIL for a moment before slurmctld requeues a --requeue job (measured: under 1 s)."""
STATE_SOURCES: tuple[Any, ...] = (job_state, scontrol_state)
"""Asked in order on every poll of `--wait`; the first that names a terminal state ends it."""


SLURM_WORDS = {
    "PENDING": "pending",
    "CONFIGURING": "pending",
    "RESV_DEL_HOLD": "pending",
    "SUSPENDED": "pending",
    "REQUEUED": "requeued",
    "REQUEUE_HOLD": "requeued",
    "REQUEUE_FED": "requeued",
    "RUNNING": "running",
    "COMPLETING": "running",
    "STAGE_OUT": "running",
    "RESIZING": "running",
    "SIGNALING": "running",
    "COMPLETED": "finished",
    "CANCELLED": "cancelled",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "PREEMPTED": "preempted",
}
"""squeue's and sacct's job states, in the project's words (torchlaunch.backends.WORDS)."""


def job_word(said: str | None) -> JobState | None:
    """Slurm's state text ("CANCELLED by 1000", "COMPLETED+") in our words; None when unknown."""
    head = said.strip().split()[0].rstrip("+").upper() if said and said.strip() else ""
    word = SLURM_WORDS.get(head)
    return JobState(word, said.strip()) if word is not None and said is not None else None


def state(job_id: str) -> str | None:
    """squeue while the job is known to the controller, else sacct's final state (status, list)."""
    if not SLURM_ID.match(job_id):
        return None
    out = tool_output(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if out and out.strip():
        return out.split()[0]
    out = tool_output(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    lines = [ln.strip() for ln in (out or "").splitlines() if ln.strip()]
    return lines[-1] if lines else None


class Slurm:
    name = "slurm"
    by_pid = False

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        """A Slurm allocation (SLURM_JOB_ID, the array form when there is one)."""
        array, task = env.get(contract.SLURM_ARRAY_JOB_ID), env.get(contract.SLURM_ARRAY_TASK_ID)
        if array and task:
            return Detected(self.name, f"{array}_{task}")
        if env.get(contract.SLURM_JOB_ID):
            return Detected(self.name, env[contract.SLURM_JOB_ID])
        return None

    def state(self, job_id: str, extra: Mapping[str, str]) -> JobState | None:
        """The job's state. A live job's successor (backends.slurm.successor) is named in a note while it
        waits behind a job still going, so an operator reading the queue knows whose pending job it is; once
        the job ended failed (its batch host lost) the successor's state is the run's, as it carries
        the run on."""
        said = state(job_id)
        word = job_word(said)
        after = extra.get(slurm_successor.SUCCESSOR_KEY, "")
        if not SLURM_ID.match(after) or (word is not None and word.word not in ("failed", "pending", "running")):
            return word
        then = state(after)
        going = job_word(then)
        if then is None or going is None or then.split()[0] not in slurm_successor.WAITING_STATES:
            return word
        if word is not None and word.word != "failed":
            why = "it resumes the run from the newest checkpoint if this job's batch host is lost"
            return JobState(word.word, word.said, note=f"successor job {after} is {then} behind job {job_id}: {why}")
        why = f"it resumes the run from the newest checkpoint if job {job_id}'s batch host was lost"
        return JobState(going.word, f"{said or 'gone'} for job {job_id}; its successor job {after} is {then} ({why})")

    def alive(self, job_id: str) -> bool:
        """Pending, running or requeued still owns the run dir; without squeue nobody can tell: alive."""
        if not have("squeue"):
            return True
        return controller_state(job_id) not in ("UNKNOWN", *TERMINAL_STATES)

    def cancel(self, run_dir: Path, nodes: Sequence[LaunchRecord]) -> list[Step]:
        """scancel, once Slurm says the job is this run's (its output under the run dir, or its comment).
        A live job's successor (backends.slurm.successor) is cancelled first, so that the job's CANCELLED
        never starts it; a job already ended whose successor carries the run on: the successor alone."""
        node0 = min(nodes, key=lambda r: r.node_rank)
        if not node0.job_id or not SLURM_ID.match(node0.job_id):
            from torchlaunch.backends.launchers import signal_launchers

            return signal_launchers(nodes)
        steps = [Step("run", ("scancel", after)) for after in successors(run_dir, node0)]
        if steps and controller_state(node0.job_id) in ("UNKNOWN", *TERMINAL_STATES):
            return steps
        why = slurm_proof.slurm_job(node0.job_id, run_dir)
        if why is not None:
            raise BadInput(f"launch error: cancel refused: Slurm job {node0.job_id} is not proven this run's: {why}")
        return [*steps, Step("run", ("scancel", node0.job_id))]

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        """submitit's per-task output files (RUN_DIR/slurm/JOB_ID/JOB_ID_TASK_log.out and .err)."""
        if not job_id or not SLURM_ID.match(job_id):
            return []
        folder = rundir.slurm(run_dir) / job_id
        try:
            return sorted(folder.glob(f"{job_id}_*_log.*"))
        except OSError:
            return []

    def claim(self, job_id: str, run_dir: Path) -> None:
        slurm_proof.claim_slurm_job(job_id, run_dir)

    launcher = "torchlaunch.backends.slurm.launch"

    def render(self, spec: Any, options: Any) -> str:
        """The sbatch script submitit would submit (launch.slurm.sbatch_script)."""
        return str(backends.load_launcher(self.launcher).sbatch_script(spec, options))

    def submit(self, argv: Sequence[str]) -> int:
        return int(backends.load_launcher(self.launcher).main(list(argv)))


BACKEND = Slurm()


def successors(run_dir: Path, node0: LaunchRecord) -> list[str]:
    """The successor job waiting or running behind the record's job (its record's extra, else the job's
    chain record), when Slurm says it is this run's (its output under the run dir). A record naming a job
    that is not this run's refuses the cancel (BadInput), as the job's own does."""
    job = node0.job_id or ""
    after = node0.extra.get(slurm_successor.SUCCESSOR_KEY, "")
    if not SLURM_ID.match(after):
        chain = slurm_successor.read(run_dir, job)
        after = chain.successor if chain is not None and chain.successor else ""
    if not after or controller_state(after) not in slurm_successor.WAITING_STATES:
        return []
    why = slurm_proof.slurm_job(after, run_dir)
    if why is not None:
        raise BadInput(
            f"launch error: cancel refused: Slurm job {after}, recorded as job {job}'s successor, is not proven this run's: {why}"
        )
    return [after]


# ----------------------------------------------------------------------------------------------
# Submitting and following a job (launch.slurm).


def result_path(folder: str | os.PathLike[str], job_id: str, task: int = 0) -> Path:
    """Where task `task` of `job_id` leaves its exit code and reason, beside submitit's own files."""
    return Path(folder) / f"{job_id}_{task}_result.json"


def read_result(folder: str | os.PathLike[str], job_id: str) -> tuple[int | None, str]:
    """(code, reason) task 0 of `job_id` recorded, or (None, "") when it left none (it was killed)."""
    data, _ = files.read_json(result_path(folder, job_id))
    if data is None:
        return None, ""
    return files.as_int(data.get("code"), 0, 255), files.as_str(data.get("why"), 1000) or ""


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gres: str


def cluster_partitions() -> dict[str, Partition] | None:
    """Partitions from sinfo, or None when no cluster is reachable (then nothing is checked)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%R|%D|%G"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    partitions: dict[str, Partition] = {}
    for line in out.splitlines():
        name, nodes, gres = line.split("|")
        known = partitions.get(name)
        count = int(nodes) + (known.nodes if known else 0)
        gres_all = ",".join(g for g in ((known.gres if known else ""), gres) if g and g != "(null)")
        partitions[name] = Partition(name, count, gres_all)
    return partitions


def default_partition() -> str | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return next((p.rstrip("*") for p in out.split() if p.endswith("*")), None)


NO_SLURM_CONF = "Could not establish a configuration source"
"""sbatch's words when neither SLURM_CONF nor the default slurm.conf nor a configless server is found."""


def no_slurm_conf_message() -> str:
    return (
        f"sbatch cannot find the cluster's slurm.conf (sbatch: fatal: {NO_SLURM_CONF}): for the local "
        f'test cluster run `eval "$(slurm/dev-cluster.sh env)"` in this shell first, otherwise '
        f"export SLURM_CONF=<your cluster's slurm.conf>"
    )


def check_slurm_conf() -> None:
    """BadInput before sbatch prints four lines of its own: sinfo finds its config exactly as sbatch does."""
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20)
    except (subprocess.SubprocessError, OSError):
        return
    if NO_SLURM_CONF in probe.stderr:
        raise BadInput(no_slurm_conf_message())


def submit_task(folder: str, python: str, max_timeouts: int, parameters: dict[str, Any], task: Any) -> Any:
    """sbatch through submitit: an executor with the rendered parameters, then the task's pickle."""
    import submitit

    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=max_timeouts, python=shlex.quote(python))
    executor.update_parameters(**parameters)
    return executor.submit(task)


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
    """The job's exit code (exit_codes.scheduler_code) from the final Slurm state and the code task 0
    recorded as data (read_result); one line on stderr unless it finished."""
    kind = state.split()[0]
    result, why = read_result(job.paths.folder, str(job.job_id)) if kind == "FAILED" else (None, "")
    code = exit_codes.scheduler_code(state, result)
    if code == OK:
        return OK
    if kind == "CANCELLED":
        print(f"job {job.job_id} was cancelled ({state}); its newest checkpoint is in the run dir", file=sys.stderr)
    elif code != FAILURE:
        print(f"worker exit code {code}: {why}", file=sys.stderr)
    else:
        print(failure_report(job.paths.folder, str(job.job_id), state), file=sys.stderr)
    return code
