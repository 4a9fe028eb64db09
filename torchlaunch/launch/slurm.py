"""Slurm launcher on submitit: one task per GPU (or per CPU worker), requeue on preemption and timeout.

    python -m launch.slurm --nodes 2 --gpus-per-node 8 --partition gpu --time 240 \\
        --config configs/cifar10.yaml run_dir=/shared/runs/a

The pure part maps a JobSpec to submitit's executor parameters and to the sbatch script submitit
would write (`--dry-run` prints it). Each task exports the env contract with submitit's
TorchDistributedEnvironment and runs its program in-process through torchlaunch.runner.main: the
built-in worker (`-m torchlaunch.worker`, the default program) or any script or module
(`... --run-dir DIR -- SCRIPT.py args` or `-- -m pkg.mod args`, run from the submission directory).
The scheduler's signal goes straight to the program's own handler (no forwarding, no second process
to race). When the program exits 75 (every rank checkpointed the same step), global rank 0 requeues
the job exactly once and the next allocation resumes from RUN_DIR's newest checkpoint; exit 2 is
never requeued. The argv grammar, the program rule and the pre-spawn policy are
torchlaunch.launch.cli's. See docs/SLURM.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchlaunch import compat, contract, exit_codes, rankpath, rundir, runlock, schedulers
from torchlaunch import config as config_mod
from torchlaunch import runner as program_mod
from torchlaunch.exit_codes import BAD_INPUT, CANCELLED, FAILURE, OK, PREEMPTED, BadInput
from torchlaunch.jobs import files, ranklog, record, watchdog
from torchlaunch.jobs.launcher import Operation, prepare_rank
from torchlaunch.launch import cli, elastic, emit, precheck, shape
from torchlaunch.launch.spec import JobSpec
from torchlaunch.schedulers.slurm import (
    LIVE_STATES,
    NODE_FAIL_REQUEUE_S,
    STATE_SOURCES,
    TERMINAL_STATES,
    controller_state,
    job_state,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN_WORKER = program_mod.BUILTIN_WORKER
PREFLIGHT = program_mod.PREFLIGHT
DEFAULT_MAX_TIMEOUTS = 3
SLURM_SIGNAL_SLACK_S = 65
"""Slurm may send the --signal up to 60 s before the requested lead time (its timer resolution)."""


@dataclass(frozen=True)
class SlurmOptions:
    """What only the Slurm launcher needs beyond the JobSpec."""

    use_gpus: bool = True
    """Request gpus_per_node GPUs per node; False runs gpus_per_node CPU worker processes per node."""
    max_timeouts: int = DEFAULT_MAX_TIMEOUTS
    """Requeues allowed after running out of time; preemptions do not count."""
    job_name: str = "train"
    python: str | None = None
    """Interpreter in each task: this one (sys.executable), or python3 inside a --image container."""
    repo_root: str = str(REPO_ROOT)
    doctor: bool = False
    """Run the distributed pre-flight in each task instead of the program."""
    explicit_master_port: bool = False
    """Without it submitit derives the port from the job id, so jobs sharing a node do not clash."""
    cwd: str | None = None
    """Submission directory: a user's program runs there (importable, as with `python -m`)."""
    hang_timeout: float | None = None
    """Seconds without progress before a node's watchdog dumps its ranks and requeues (None: automatic, 0: off)."""
    console: ranklog.Console = ranklog.Console()
    """Which ranks' output reaches each task's output file, and whether each line names its rank."""
    command: tuple[str, ...] = ()
    """The submitting command line, kept in the job record."""


# ----------------------------------------------------------------------------------------------
# Pure part: JobSpec -> worker argv, submitit parameters, sbatch script.


def resolve_run_dir(spec: JobSpec) -> str:
    """The run dir from the spec, a `run_dir=` override or the YAML; logs and checkpoints live there."""
    if spec.program and not spec.run_dir:
        raise BadInput(
            "no run dir: pass --run-dir /shared/path with a program after -- "
            "(the Slurm logs and submitit's files go there)"
        )
    run_dir = spec.run_dir
    for override in spec.overrides:
        key, _, value = override.partition("=")
        if key.strip() == "run_dir":
            run_dir = value.strip()
    if run_dir is None:
        run_dir = _yaml_run_dir(spec.config)
    if not run_dir:
        raise BadInput(f"no run dir: pass run_dir=/shared/path (config {spec.config} sets none)")
    return emit.sbatch_path(os.path.abspath(run_dir), "--run-dir" if spec.program else "run_dir")


def _yaml_run_dir(config: str) -> str | None:
    from torchlaunch.config import read_yaml  # the one bounded reader of config files

    value = read_yaml(config).get("run_dir")
    return str(value) if value else None


def worker_argv(spec: JobSpec, run_dir: str) -> list[str]:
    """Arguments of the built-in worker (`-m torchlaunch.worker`): identical on every rank and every requeue. The signal lead time is
    passed on so the worker can warn when a checkpoint would not fit in it."""
    keys = {o.partition("=")[0].strip() for o in spec.overrides}
    overrides = [o for o in spec.overrides if o.partition("=")[0].strip() != "run_dir"]
    if "preemption.lead_time_s" not in keys:
        overrides.append(f"preemption.lead_time_s={spec.signal_delay_s}")
    return ["--config", os.path.abspath(spec.config), *overrides, f"run_dir={run_dir}"]


def doctor_recipe(run_dir: str) -> str:
    """train.preflight reads a recipe; a user's program has none: defaults, synthetic data, its run dir."""
    return os.path.join(run_dir, "doctor.yaml")


def task_argv(spec: JobSpec, options: SlurmOptions, run_dir: str) -> list[str]:
    """What every task's runner runs: the built-in worker (or the pre-flight) on the recipe, or the
    user's program."""
    if not spec.program:
        return ["-m", PREFLIGHT if options.doctor else BUILTIN_WORKER, *worker_argv(spec, run_dir)]
    if options.doctor:
        return ["-m", PREFLIGHT, "--config", doctor_recipe(run_dir), f"preemption.lead_time_s={spec.signal_delay_s}"]
    return list(spec.program)


def submitit_folder(run_dir: str) -> str:
    return os.path.join(rundir.slurm(run_dir), "%j")


def task_python(spec: JobSpec, options: SlurmOptions) -> str:
    return options.python or ("python3" if spec.image else sys.executable)


def executor_parameters(spec: JobSpec, options: SlurmOptions, run_dir: str) -> dict[str, Any]:
    """submitit.SlurmExecutor.update_parameters(**this): one task per GPU / CPU worker."""
    setup = [
        # torchlaunch only (rankpath): the project's tests/, bench/ ... never shadow the user's packages.
        f"export PYTHONPATH={emit.shell_word(str(Path(options.repo_root, rankpath.FOLDER.name)), 'the repository root')}"
        "${PYTHONPATH:+:$PYTHONPATH}"
    ]
    if options.explicit_master_port:
        setup.append(f"export MASTER_PORT={spec.master_port}")
    if spec.program:
        # A comment for the reader: escaped to one line, so no argument can end it and add a command.
        setup.append(emit.command_comment("program in every task (torchlaunch.runner)", spec.program))
        if options.cwd:
            setup.append("cd " + emit.shell_word(options.cwd, "the submission directory"))
    params: dict[str, Any] = {
        "job_name": emit.sbatch_value(options.job_name, "--job-name"),
        "nodes": spec.nodes,
        "ntasks_per_node": spec.gpus_per_node,
        "time": spec.time_min,
        "signal_delay_s": spec.signal_delay_s,
        "setup": setup,
        # --requeue: the job stays eligible for requeue after preemption, node failure or our
        # own `scontrol requeue` even where the cluster sets JobRequeue=0.
        "additional_parameters": {
            "requeue": True,
            **{emit.sbatch_key(k): emit.sbatch_value(v, f"--sbatch {k}") for k, v in spec.extra.items()},
        },
    }
    if options.use_gpus:
        params["gpus_per_node"] = spec.gpus_per_node
    optional = {
        "partition": spec.partition,
        "account": spec.account,
        "qos": spec.qos,
        "constraint": spec.constraint,
        "cpus_per_task": spec.cpus_per_task,
        "mem": f"{spec.mem_gb}GB" if spec.mem_gb is not None else None,
    }
    params.update(
        {
            key: emit.sbatch_value(value, f"--{key.replace('_', '-')}")
            for key, value in optional.items()
            if value is not None
        }
    )
    if spec.image:
        # pyxis: every task runs inside the image with the repo and the run dir mounted.
        emit.refuse_control(spec.image, "--image", "pass a single-line image name")
        mounts = ",".join(
            f"{path}:{path}"
            for path in (
                emit.container_mount(options.repo_root, "the repository root"),
                emit.container_mount(run_dir, "the run dir"),
            )
        )
        params["srun_args"] = [
            "--container-image",
            spec.image,
            "--container-mounts",
            mounts,
            "--container-workdir",
            options.repo_root,
        ]
    return elastic.slurm_parameters(spec, params)


def submitit_command(python: str, folder: str) -> str:
    """What submitit runs in each task (SlurmExecutor._submitit_command_str, with our python)."""
    return " ".join([shlex.quote(python), f"-u -m {compat.SUBMITIT_TASK_MODULE}", shlex.quote(folder)])


def sbatch_script(spec: JobSpec, options: SlurmOptions) -> str:
    """The sbatch script submitit submits for this spec, rendered without a cluster."""
    from submitit.slurm.slurm import _make_sbatch_string

    run_dir = resolve_run_dir(spec)
    folder = submitit_folder(run_dir)
    params = executor_parameters(spec, options, run_dir)
    return _make_sbatch_string(command=submitit_command(task_python(spec, options), folder), folder=folder, **params)


# ----------------------------------------------------------------------------------------------
# What runs in each Slurm task.


class WorkerExit(RuntimeError):
    """Raised in a task so submitit records a failure (and Slurm does not requeue): carries the code.
    submitit keeps only the traceback's text; the code reaches `--wait` as data, through the task's
    result record (write_result), never parsed back out of this message."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(f"worker exit code {code}: {why}")
        self.code = code
        self.why = why
        write_result(code, why)


def result_path(folder: str | os.PathLike[str], job_id: str, task: int = 0) -> Path:
    """Where task `task` of `job_id` leaves its exit code and reason, beside submitit's own files."""
    return Path(folder) / f"{job_id}_{task}_result.json"


def write_result(code: int, why: str) -> None:
    """In a task of a submitit job: record its final code and reason for `--wait` (exit_status). Outside
    one (a unit test calling a task's method), or when the folder cannot be written, nothing."""
    try:
        import submitit

        env = submitit.JobEnvironment()
        rundir.write_json(result_path(env.paths.folder, str(env.job_id), env.global_rank), {"code": code, "why": why})
    except Exception:  # noqa: BLE001 - the result record is a courtesy to --wait: the job's end comes first
        pass


def read_result(folder: str | os.PathLike[str], job_id: str) -> tuple[int | None, str]:
    """(code, reason) task 0 of `job_id` recorded, or (None, "") when it left none (it was killed)."""
    data, _ = files.read_json(result_path(folder, job_id))
    if data is None:
        return None, ""
    return files.as_int(data.get("code"), 0, 255), files.as_str(data.get("why"), 1000) or ""


def is_timeout(elapsed_s: float, time_min: int, signal_delay_s: int) -> bool:
    """A stop counts as a timeout only inside the allocation's final signal window.

    Slurm sends the time-limit signal signal_delay_s (up to 60 s more) before the end; a signal
    earlier than that is a preemption and must not spend the timeout budget. submitit's own rule,
    run time >= min(0.8 T, T - 10 min), calls every signal in a job of T <= 10 min a timeout.
    """
    return elapsed_s >= time_min * 60 - signal_delay_s - SLURM_SIGNAL_SLACK_S


def leave(code: int) -> None:
    """Exit now with `code`, output flushed, without a submitit result and without running C++
    static destructors (see the OK path in SlurmTask.__call__)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    max_hang_requeues: int = 1
    timeouts: int = 0
    preemptions: int = 0
    hangs: int = 0
    history: list[str] = field(default_factory=list)

    def __call__(self) -> int:
        import submitit

        started = time.time()
        # One thread per allotted CPU: torch would otherwise start a thread per core in every task.
        os.environ.setdefault("OMP_NUM_THREADS", contract.get(contract.SLURM_CPUS_PER_TASK, "1") or "1")
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        rank = dist_env.rank
        print(
            f"slurm task: rank {rank}/{dist_env.world_size} local {dist_env.local_rank} "
            f"master {dist_env.master_addr}:{dist_env.master_port} "
            f"(timeouts {self.timeouts}/{self.max_timeouts}, preemptions {self.preemptions}) on {socket.gethostname()}",
            flush=True,
        )
        op = self._operation(dist_env.local_rank, dist_env.local_world_size)
        if self.cwd:
            os.chdir(self.cwd)
        code = program_mod.main(list(self.argv))  # the one runner, as in every launcher
        # The program restored submitit's handlers; from here on a late USR2/TERM must not make
        # submitit requeue a second time.
        for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        if op is not None:
            code = op.finish(code)
        if code == OK:
            if rank == 0 and self.run_dir:
                runlock.release_for_job(self.run_dir, "slurm", contract.get(contract.SLURM_JOB_ID, "") or "")
            # submitit writes the result after we return; then skip C++ static destructors, which
            # sometimes abort a rank at exit on torch 2.14.1 ("terminate called without an active
            # exception") and would turn a finished job into FAILED.
            atexit.register(leave, OK)
            return OK
        if code == CANCELLED:
            raise WorkerExit(
                code,
                f"job {contract.get(contract.SLURM_JOB_ID, '')} was cancelled (python -m launch cancel), not requeued; "
                "a checkpoint is committed: submit the same command again to resume",
            )
        if code == PREEMPTED:
            self._requeue(rank, time.time() - started)
        if code == BAD_INPUT:
            raise WorkerExit(code, "bad input, not requeued; fix the config and submit again")
        raise WorkerExit(code, "worker failed; see this task's log")

    def launch_id(self) -> str:
        """This allocation of the job: the same on every node, new after each requeue."""
        return f"{contract.get(contract.SLURM_JOB_ID, '0')}-{contract.get(contract.SLURM_RESTART_COUNT) or 0}"

    def _operation(self, local_rank: int, local_world_size: int) -> Operation | None:
        """Rank env and per-rank logs for this task; the node's local rank 0 also records the node's
        launch and runs its hang watchdog. None without a run dir (nothing to record into)."""
        if not self.run_dir:
            return None
        op = Operation(
            self.run_dir,
            scheduler="slurm",
            command=self.command or list(self.argv),
            launch_id=self.launch_id(),
            job_id=contract.get(contract.SLURM_JOB_ID),
            node_rank=int(contract.get(contract.SLURM_NODEID, "0") or "0"),
            nnodes=int(contract.get(contract.SLURM_NNODES, "1") or "1"),
            local_ranks=local_world_size,
            hang_timeout=self.hang_timeout,
            console=ranklog.Console.from_env(self.console_env),
        )
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
            requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
            print(
                f"slurm task: hang: job {job_id} requeued ({self.hangs}/{self.max_hang_requeues}) "
                f"{requeue.stderr.strip()}",
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

    def _requeue(self, rank: int, elapsed_s: float) -> None:
        """Rank 0 requeues once; every rank leaves without a result so submitit waits for the rerun."""
        timed_out = is_timeout(elapsed_s, self.time_min, self.signal_delay_s)
        if rank != 0:
            print("slurm task: checkpoint committed; rank 0 requeues", flush=True)
            leave(PREEMPTED)
        job_id = contract.require(contract.SLURM_JOB_ID)
        if self.run_dir and record.cancel_requested(self.run_dir, self.launch_id()):
            raise WorkerExit(
                CANCELLED,
                f"job {job_id} was cancelled (python -m launch cancel), not requeued; a checkpoint is "
                "committed: submit the same command again to resume",
            )
        live_state = controller_state(job_id)
        if live_state != "RUNNING":
            # scancel (or the hard time limit) got here first: the job is ending for good.
            raise WorkerExit(
                PREEMPTED,
                f"job {job_id} is {live_state}, not requeued; a checkpoint is "
                "committed: submit the same command again to resume",
            )
        if timed_out and self.timeouts >= self.max_timeouts:
            raise WorkerExit(
                PREEMPTED,
                f"timed out {self.timeouts + 1} times (limit {self.max_timeouts}); "
                "a checkpoint is committed: submit the same command again to resume",
            )
        self.timeouts += timed_out
        self.preemptions += not timed_out
        kind = "timeout" if timed_out else "preemption"
        self.history.append(f"{kind} after {elapsed_s:.0f}s")
        self._save_for_requeue()
        # Needed for preemption too: Slurm requeues a preempted job only if it is still running when
        # GraceTime ends; a job whose tasks exit earlier would just complete. Requeueing now also
        # frees the nodes at once. If Slurm's own requeue won the race, ours is refused: fine.
        # Leaving without a result pickle is what keeps submitit waiting for the next allocation.
        requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        if requeue.returncode != 0:
            print(f"slurm task: scontrol requeue: {requeue.stderr.strip()} (state {job_state(job_id)})", flush=True)
        said = program_mod.last_reason
        what = said if program_mod.stopped_by_runner(said) else "checkpoint committed"
        print(
            f"slurm task: {kind}: {what}, job {job_id} requeued "
            f"(timeouts {self.timeouts}/{self.max_timeouts}, preemptions {self.preemptions})",
            flush=True,
        )
        leave(PREEMPTED)

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


# ----------------------------------------------------------------------------------------------
# Talking to the cluster (validation, submission, following).


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


def validate(spec: JobSpec, options: SlurmOptions, partitions: dict[str, Partition] | None) -> None:
    """Raise BadInput (one line, exit 2) for what the cluster would reject or never schedule."""
    if options.max_timeouts < 0:
        raise BadInput(f"--max-timeouts must be >= 0, got {options.max_timeouts}")
    if spec.time_min < 1:
        raise BadInput(f"--time must be >= 1 minute, got {spec.time_min}")
    if spec.signal_delay_s < 1 or spec.signal_delay_s >= spec.time_min * 60:
        raise BadInput(f"--signal-delay-s must be between 1 and --time*60-1 s, got {spec.signal_delay_s}")
    if partitions is None:
        return
    name = spec.partition or default_partition()
    if name is None:
        return
    partition = partitions.get(name)
    if partition is None:
        raise BadInput(f"unknown partition {name!r}; this cluster has: {', '.join(sorted(partitions))}")
    if (spec.min_nodes or spec.nodes) > partition.nodes:
        raise BadInput(f"--nodes {spec.min_nodes or spec.nodes} but partition {name!r} has {partition.nodes} nodes")
    if options.use_gpus and "gpu" not in partition.gres:
        raise BadInput(
            f"partition {name!r} has no GPUs (GRES: {partition.gres or 'none'}); "
            "use --tasks-per-node N for CPU workers or a GPU partition"
        )


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


def submit(spec: JobSpec, options: SlurmOptions) -> Any:
    """Own the run dir, submit, hand the run dir to the job and record it as pending for `launch status`."""
    run_dir = resolve_run_dir(spec)
    lock = runlock.acquire(run_dir, job_alive=schedulers.alive)  # before anything is written there
    try:
        job = _submit(spec, options, run_dir)
    except BaseException:
        lock.release()
        raise
    lock.hand_over("slurm", job.job_id)  # the job owns the run dir now; its rank 0 frees it when done
    record.start(
        run_dir,
        scheduler="slurm",
        command=list(options.command),
        launch_id=f"{job.job_id}-0",
        job_id=str(job.job_id),
        nnodes=spec.nodes,
        local_ranks=spec.gpus_per_node,
    )
    return job


def _submit(spec: JobSpec, options: SlurmOptions, run_dir: str) -> Any:
    import submitit

    executor = submitit.SlurmExecutor(
        folder=submitit_folder(run_dir),
        max_num_timeout=options.max_timeouts,
        python=shlex.quote(task_python(spec, options)),
    )
    executor.update_parameters(**executor_parameters(spec, options, run_dir))
    if spec.program and options.doctor:
        with open(doctor_recipe(run_dir), "w", encoding="utf-8") as recipe:
            recipe.write(f"run_dir: {json.dumps(run_dir)}\ndata:\n  name: synthetic\n")
    task = SlurmTask(
        argv=task_argv(spec, options, run_dir),
        time_min=spec.time_min,
        signal_delay_s=spec.signal_delay_s,
        max_timeouts=options.max_timeouts,
        cwd=options.cwd if spec.program else None,
        run_dir=run_dir,
        command=list(options.command),
        hang_timeout=options.hang_timeout,
        console_env=options.console.env(),
    )
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
        if state is not None and state.split()[0] == "NODE_FAIL":
            node_failed_at = node_failed_at or time.monotonic()
            if time.monotonic() - node_failed_at < NODE_FAIL_REQUEUE_S:
                state = None  # Slurm requeues a --requeue job after a node failure: NODE_FAIL comes first
        for i, (path, stream) in enumerate(streams):
            if path.exists():
                with open(path, encoding="utf-8", errors="replace") as f:
                    f.seek(offsets[i])
                    chunk = f.read()
                    offsets[i] = f.tell()
                stream.write(chunk)
                stream.flush()
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


TAIL_LINES = 20
SUBMITIT_ERROR = "Submitted job triggered an exception"
"""submitit's line before its traceback of the task's exception (the runner already printed the program's)."""
TASK_LINE = re.compile(r"^slurm task: rank (\d+)/\d+ .* on (\S+)$", re.MULTILINE)


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
        if not task.isdigit():
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


# ----------------------------------------------------------------------------------------------
# Command line.


def check_shape(args: argparse.Namespace) -> None:
    """Numbers Slurm would refuse late (inside the job) or never schedule (pending forever)."""
    args.node_range = elastic.parse_nodes("--nodes", args.nodes, "2 or --nodes 1-2")
    shape.within("--gpus-per-node", args.gpus_per_node, 1, shape.MAX_PER_NODE, "8")
    shape.within("--tasks-per-node", args.tasks_per_node, 1, shape.MAX_PER_NODE, "4")
    shape.within("--time", args.time, 1, 366 * 24 * 60, "240")
    shape.within("--cpus-per-task", args.cpus_per_task, 1, 4096, "8")
    shape.within("--mem-gb", args.mem_gb, 1, 1 << 16, "64")
    shape.within("--signal-delay-s", args.signal_delay_s, 0, 3600, "90")
    shape.within("--max-timeouts", args.max_timeouts, 0, shape.MAX_RESTARTS, "3")
    shape.port("--master-port", args.master_port)
    if args.tasks_per_node is not None:
        cpus = shape.slurm_node_cpus(args.partition)
        need = args.tasks_per_node * (args.cpus_per_task or 1)
        if cpus is not None and need > cpus:
            raise cli.error(
                f"--tasks-per-node {args.tasks_per_node} x --cpus-per-task {args.cpus_per_task or 1} needs {need} "
                f"CPUs per node, the largest node{' of ' + args.partition if args.partition else ''} has {cpus} "
                f"(the job would pend forever; use --tasks-per-node {max(1, cpus // (args.cpus_per_task or 1))})"
            )


def parse_args(argv: list[str]) -> tuple[JobSpec, SlurmOptions, argparse.Namespace]:
    parser = cli.Parser(
        prog="python -m launch.slurm",
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [options] --config YAML [key=value ...] | "
        "[options] --run-dir DIR -- SCRIPT.py [args] | ... -- -m MODULE [args]",
    )
    cli.add_common(
        parser,
        config_help="recipe of the built-in worker (not with a program after --)",
        run_dir_help="with a program after --: the shared folder for logs and "
        "submitit's files (the built-in worker takes run_dir=)",
    )
    parser.add_argument(
        "--nodes",
        default="1",
        help="nodes, or a range MIN-MAX: an allocation of any size in it, and after a node failure the job "
        "is requeued onto the nodes that are up (torchlaunch.launch.elastic)",
    )
    workers = parser.add_mutually_exclusive_group()
    workers.add_argument("--gpus-per-node", type=int, help="GPUs per node, one task per GPU")
    workers.add_argument("--tasks-per-node", type=int, help="CPU worker processes per node (no GPUs)")
    parser.add_argument("--partition")
    parser.add_argument("--time", type=int, default=60, help="minutes per allocation")
    parser.add_argument("--cpus-per-task", type=int)
    parser.add_argument("--mem-gb", type=int)
    parser.add_argument("--account")
    parser.add_argument("--qos")
    parser.add_argument("--constraint")
    parser.add_argument("--signal-delay-s", type=int, default=90)
    parser.add_argument("--max-timeouts", type=int, default=DEFAULT_MAX_TIMEOUTS)
    parser.add_argument("--master-port", type=int)
    parser.add_argument(
        "--sbatch", action="append", default=[], metavar="KEY=VALUE", help="extra #SBATCH --KEY=VALUE (repeatable)"
    )
    parser.add_argument("--image", help="container image, run with pyxis (srun --container-image)")
    parser.add_argument("--python", help="interpreter in each task (default: this one; python3 with --image)")
    parser.add_argument("--job-name", help="default: train, or the program's name")
    parser.add_argument("--wait", action="store_true", help="follow rank 0's log; exit with the job's status")
    cli.add_operation(
        parser,
        hang_help="seconds without progress before the ranks' stacks are dumped and the job is requeued once "
        "(default: max(10 min, 50 steps); 0: off)",
    )
    args = cli.parse(parser, argv)
    program = cli.check_program(args, cwd=os.getcwd(), absolute=True)

    extra: dict[str, str] = {}
    for item in args.sbatch:
        key, sep, value = item.partition("=")
        if not key:
            raise BadInput(f"--sbatch {item!r} is not KEY=VALUE")
        extra[key.lstrip("-")] = value if sep else True  # type: ignore[assignment]
    check_shape(args)
    use_gpus = args.tasks_per_node is None
    per_node = args.gpus_per_node if use_gpus else args.tasks_per_node
    if per_node is None:
        per_node = 1
    try:
        spec = JobSpec(
            config=args.config or "",
            overrides=tuple(args.overrides),
            nodes=args.node_range.max,
            min_nodes=args.node_range.min if args.node_range.elastic else None,
            gpus_per_node=per_node,
            program=tuple(program.argv()) if program else (),
            run_dir=os.path.abspath(args.run_dir) if args.run_dir else None,
            master_port=args.master_port or JobSpec.master_port,
            time_min=args.time,
            partition=args.partition,
            account=args.account,
            qos=args.qos,
            constraint=args.constraint,
            cpus_per_task=args.cpus_per_task,
            mem_gb=args.mem_gb,
            signal_delay_s=args.signal_delay_s,
            image=args.image,
            extra=extra,
        )
    except ValueError as error:
        flag = (
            str(error)
            .replace("nodes must", "--nodes must")
            .replace("gpus_per_node must", "--gpus-per-node/--tasks-per-node must")
        )
        raise BadInput(flag) from None
    job_name = args.job_name or (Path(program.name).stem.rpartition(".")[2] if program else "train")
    options = SlurmOptions(
        use_gpus=use_gpus,
        max_timeouts=args.max_timeouts,
        job_name=job_name,
        python=args.python,
        explicit_master_port=args.master_port is not None,
        doctor=args.doctor,
        cwd=os.getcwd() if program else None,
        hang_timeout=args.hang_timeout,
        console=cli.console_of(args),
        command=("python", "-m", "launch.slurm", *argv),
    )
    return spec, options, args


def main(argv: list[str] | None = None) -> int:
    return cli.main(lambda: launch(sys.argv[1:] if argv is None else argv))


def launch(argv: list[str]) -> int:
    """Parse, apply the pre-spawn policy, then print the sbatch script (--dry-run) or submit."""
    spec, options, args = parse_args(argv)
    validate(spec, options, None)
    # Every value through the emitters now: bad text is exit 2 before anything is written or submitted.
    executor_parameters(spec, options, resolve_run_dir(spec))
    if not spec.program:
        cfg = config_mod.load(spec.config, spec.overrides)
        precheck.check(cfg, on_cpu=not options.use_gpus, local=False, doctor=options.doctor)
    if args.dry_run:
        print(sbatch_script(spec, options), end="")
        return OK
    if shutil.which("sbatch") is None:
        raise BadInput("sbatch not found: run this on a Slurm login node (or use --dry-run)")
    check_slurm_conf()
    validate(spec, options, cluster_partitions())
    try:
        job = submit(spec, options)
    except BadInput:
        raise
    except Exception as error:  # noqa: BLE001 - sbatch refused (e.g. no controller): one line, no traceback
        if NO_SLURM_CONF in str(error):
            raise BadInput(no_slurm_conf_message()) from None
        last = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        print(f"{cli.PREFIX}submission failed: {last}", file=sys.stderr)
        return FAILURE
    log = rank0_log(job)
    print(f"submitted job {job.job_id}: {spec.nodes} node(s) x {spec.gpus_per_node} task(s)")
    print(f"  rank 0 log: {log}")
    print(f"  all logs:   {job.paths.folder}")
    print(f"  follow:     tail -F {log}")
    print(f"  status:     sacct -j {job.job_id}")
    print(f"  cancel:     scancel {job.job_id}", flush=True)
    if not args.wait:
        return OK
    return follow(job)


if __name__ == "__main__":
    sys.exit(main())
