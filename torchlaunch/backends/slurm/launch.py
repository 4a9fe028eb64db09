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

This module is the command line and the pure render (JobSpec -> executor parameters, sbatch script,
the task's argv); the in-task runtime is torchlaunch.backends.slurm.task and the cluster I/O (sinfo, sbatch
through submitit, following a job) is torchlaunch.backends.slurm.operate.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch import backends, compat, rankpath, rundir, runlock
from torchlaunch import config as config_mod
from torchlaunch import runner as program_mod
from torchlaunch.backends.slurm import live as slurm_live
from torchlaunch.backends.slurm.operate import (
    NO_SLURM_CONF,
    Partition,
    check_slurm_conf,
    cluster_partitions,
    default_partition,
    follow,
    no_slurm_conf_message,
    rank0_log,
    submit_task,
)
from torchlaunch.backends.slurm.task import DEFAULT_MAX_TIMEOUTS, SlurmTask
from torchlaunch.exit_codes import FAILURE, OK, BadInput
from torchlaunch.jobs import ranklog, record
from torchlaunch.launch import cli, emit, precheck, shape
from torchlaunch.launch.shape import NodeRange
from torchlaunch.launch.spec import JobSpec

REPO_ROOT = rankpath.REPO_ROOT
"""The checkout the tasks import torchlaunch from (its rankpath/ folder) and pyxis mounts."""
BUILTIN_WORKER = program_mod.BUILTIN_WORKER
PREFLIGHT = program_mod.PREFLIGHT


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
    lighthouse: str = ""
    """Live recovery (recovery.live): the membership service apart from the job's nodes; '' when the job
    is not live (backends.slurm.live.lighthouse_of decides)."""
    grace_time_s: int | None = None
    """The partition's GraceTime (a preempted job's time between the signal and SIGKILL), where scontrol
    said it at submission: the worker's lead time is the shorter of it and the --signal lead time."""


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


def worker_argv(spec: JobSpec, run_dir: str, grace_time_s: int | None = None) -> list[str]:
    """Arguments of the built-in worker (`-m torchlaunch.worker`): identical on every rank and every requeue. The signal lead time
    (or the partition's GraceTime, when shorter: a preemption's) is passed on so the worker can warn when a checkpoint would
    not fit in it."""
    keys = {o.partition("=")[0].strip() for o in spec.overrides}
    overrides = [o for o in spec.overrides if o.partition("=")[0].strip() != "run_dir"]
    if "preemption.lead_time_s" not in keys:
        lead = min(spec.signal_delay_s, grace_time_s) if grace_time_s else spec.signal_delay_s
        overrides.append(f"preemption.lead_time_s={lead}")
    return ["--config", os.path.abspath(spec.config), *overrides, f"run_dir={run_dir}"]


def doctor_recipe(run_dir: str) -> str:
    """train.preflight reads a recipe; a user's program has none: defaults, synthetic data, its run dir."""
    return os.path.join(run_dir, "doctor.yaml")


def task_argv(spec: JobSpec, options: SlurmOptions, run_dir: str) -> list[str]:
    """What every task's runner runs: the built-in worker (or the pre-flight) on the recipe, or the
    user's program."""
    if not spec.program:
        return [
            "-m",
            PREFLIGHT if options.doctor else BUILTIN_WORKER,
            *worker_argv(spec, run_dir, options.grace_time_s),
        ]
    if options.doctor:
        return ["-m", PREFLIGHT, "--config", doctor_recipe(run_dir), f"preemption.lead_time_s={spec.signal_delay_s}"]
    return list(spec.program)


def submitit_folder(run_dir: str) -> str:
    return os.path.join(rundir.slurm(run_dir), "%j")


def task_python(spec: JobSpec, options: SlurmOptions) -> str:
    return options.python or ("python3" if spec.image else sys.executable)


def batch_shell_stop(name: str = "srun") -> tuple[str, ...]:
    """BATCH_SHELL_STOP's lines with the wrapper function called `name` (live mode wraps it once more)."""
    return (
        "# Stop signals to this batch shell (scancel --full, #SBATCH --signal=B:...) reach the tasks through srun;",
        "# the shell waits for them (their checkpoint and requeue) instead of dying and taking the job with it.",
        f"{name}() {{ local step= early=; "
        'trap \'early=USR2; [ -n "$step" ] && kill -USR2 "$step" 2>/dev/null\' TERM INT HUP; '
        'trap \'early=USR1; [ -n "$step" ] && kill -USR1 "$step" 2>/dev/null\' USR1; '
        'trap \'early=USR2; [ -n "$step" ] && kill -USR2 "$step" 2>/dev/null\' USR2; '
        'command srun "$@" & step=$!; '
        '[ -n "$early" ] && kill -"$early" "$step" 2>/dev/null; '
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; done; '
        'trap - TERM INT HUP USR1 USR2; wait "$step"; }',
    )


BATCH_SHELL_STOP = batch_shell_stop()
"""The batch script's lines before submitit's `srun ...`: a shell function of that name runs the real srun
in the background and waits for it, passing each stop signal the shell gets on to srun, which forwards
SIGUSR1 and SIGUSR2 to every task. SIGTERM, SIGINT and SIGHUP go on as SIGUSR2, a stop to every rank:
srun itself ends its job step on SIGTERM ("forcing job termination") and reads a lone SIGINT as a request
for its status. A shell without it dies of the first such signal (bash's default action) and Slurm ends
the job before the ranks can checkpoint. Every stop signal is one stop to a rank, however many times it
arrives. What no batch script can change: `scancel --full --signal=TERM` also reaches srun, which then
ends the step (Slurm's design); `--full` with SIGUSR1/SIGUSR2, as Slurm's own --signal sends, is a stop."""


def executor_parameters(spec: JobSpec, options: SlurmOptions, run_dir: str) -> dict[str, Any]:
    """submitit.SlurmExecutor.update_parameters(**this): one task per GPU / CPU worker."""
    setup = [
        *(batch_shell_stop(slurm_live.STEP_FUNCTION) if options.lighthouse else BATCH_SHELL_STOP),
        # torchlaunch only (rankpath): the project's tests/, bench/ ... never shadow the user's packages.
        f"export PYTHONPATH={emit.shell_word(str(Path(options.repo_root, rankpath.FOLDER.name)), 'the repository root')}"
        "${PYTHONPATH:+:$PYTHONPATH}",
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
    return elastic_parameters(spec, live_parameters(spec, options, run_dir, params))


def live_parameters(spec: JobSpec, options: SlurmOptions, run_dir: str, params: dict[str, Any]) -> dict[str, Any]:
    """submitit's executor parameters of a live job (unchanged otherwise): sbatch and srun --no-kill and
    srun --kill-on-bad-exit=0, so a lost node's task ends neither the job nor the others' tasks, and the
    batch script's srun judged by the survivors' records (backends.slurm.live, measured there)."""
    if not options.lighthouse:
        return params
    out = dict(params)
    out["additional_parameters"] = {**out["additional_parameters"], "no_kill": True}
    out["srun_args"] = [*slurm_live.SRUN_ARGS, *out.get("srun_args", [])]
    out["setup"] = [*out["setup"], *slurm_live.batch_lines(task_python(spec, options), run_dir, spec.gpus_per_node)]
    return out


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
# Checking against the cluster, and submitting.


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


def settle_config(cfg: config_mod.RunConfig | None, reconfigure: bool, *, write: bool) -> config_mod.Settled | None:
    """RUN_DIR/config.yaml by the launchers' one rule (config.settle_resolved): a run dir started with
    another config is refused in one line unless --reconfigure (a dry run applies the refusal and writes
    nothing). At submit it is written under the run-dir lock, so every task and requeue of the job resolves
    the same values again (its rank 0 finds no change). None for a user's program (no config)."""
    if cfg is None:
        return None
    settled = config_mod.settle_resolved(cfg, reconfigure=reconfigure, write=write)
    if settled.note and write:
        print(settled.note, file=sys.stderr, flush=True)
    return settled


def submit(
    spec: JobSpec, options: SlurmOptions, cfg: config_mod.RunConfig | None = None, reconfigure: bool = False
) -> Any:
    """Own the run dir, settle its config (`cfg`: the built-in worker's), submit, hand the run dir to the
    job and record it as pending for `launch status`."""
    run_dir = resolve_run_dir(spec)
    lock = runlock.acquire(run_dir, job_alive=backends.alive)  # before anything is written there
    settled: config_mod.Settled | None = None
    try:
        if not options.doctor:  # the pre-flight never rewrites the run's config
            settled = settle_config(cfg, reconfigure, write=True)
        job = _submit(spec, options, run_dir)
    except BaseException:
        if settled is not None and config_mod.restore_resolved(settled):
            print(f"launch: {settled.path} is the run's previous config again (not submitted)", file=sys.stderr)
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
    """The rendered executor parameters and task, handed to the cluster (backends.slurm.submit_task)."""
    parameters = executor_parameters(spec, options, run_dir)
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
        lighthouse=options.lighthouse,
        live_minimum=slurm_live.minimum_env(spec.min_nodes, spec.nodes) if options.lighthouse else {},
    )
    return submit_task(submitit_folder(run_dir), task_python(spec, options), options.max_timeouts, parameters, task)


# ----------------------------------------------------------------------------------------------
# Command line.


def check_shape(args: argparse.Namespace) -> None:
    """Numbers Slurm would refuse late (inside the job) or never schedule (pending forever)."""
    shape.check(args, node_example="2 or --nodes 1-2")
    if args.tasks_per_node is not None:
        cpus = node_cpus(args.partition)
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
    shape.add(
        parser,
        "nodes",
        default="1",
        help="nodes, or a range MIN-MAX: an allocation of any size in it, and after a node failure the job "
        "is requeued onto the nodes that are up (torchlaunch.launch.elastic)",
    )
    workers = parser.add_mutually_exclusive_group()
    shape.add(workers, "gpus_per_node", help="GPUs per node, one task per GPU")
    shape.add(workers, "tasks_per_node")
    parser.add_argument("--partition")
    shape.add(parser, "time", default=60)
    shape.add(parser, "cpus_per_task")
    shape.add(parser, "mem_gb")
    parser.add_argument("--account")
    parser.add_argument("--qos")
    parser.add_argument("--constraint")
    shape.add(parser, "signal_delay_s", default=90)
    shape.add(parser, "max_timeouts", default=DEFAULT_MAX_TIMEOUTS)
    shape.add(parser, "master_port", help="rendezvous port on node 0 (default: submitit's, derived from the job id)")
    parser.add_argument(
        "--sbatch", action="append", default=[], metavar="KEY=VALUE", help="extra #SBATCH --KEY=VALUE (repeatable)"
    )
    parser.add_argument("--image", help="container image, run with pyxis (srun --container-image)")
    parser.add_argument("--python", help="interpreter in each task (default: this one; python3 with --image)")
    parser.add_argument("--job-name", help="default: train, or the program's name")
    parser.add_argument("--wait", action="store_true", help="follow rank 0's log; exit with the job's status")
    cli.add_reconfigure(parser)
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
    if spec.program and args.reconfigure:
        raise cli.error("--reconfigure changes the built-in worker's RUN_DIR/config.yaml; a program after -- has none")
    cfg: config_mod.RunConfig | None = None
    if not spec.program:
        cfg = config_mod.load(spec.config, spec.overrides)
        precheck.check(cfg, on_cpu=not options.use_gpus, local=False, doctor=options.doctor)
        options = with_live(options, cfg, spec)
        if not options.doctor:
            settle_config(cfg, args.reconfigure, write=False)  # refused before anything is written or printed
    if args.dry_run:
        print(sbatch_script(spec, options), end="")
        return OK
    if shutil.which("sbatch") is None:
        raise BadInput("sbatch not found: run this on a Slurm login node (or use --dry-run)")
    check_slurm_conf()
    validate(spec, options, cluster_partitions())
    options = dataclasses.replace(options, grace_time_s=partition_grace_s(spec.partition or default_partition()))
    try:
        job = submit(spec, options, cfg, args.reconfigure)
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


def with_live(options: SlurmOptions, cfg: config_mod.RunConfig, spec: JobSpec) -> SlurmOptions:
    """The options with the live job's membership service (recovery.live), or as they were; bad input
    in one line before anything is written (backends.slurm.live.lighthouse_of). The pre-flight is never
    live. torchft is checked here, where the tasks' interpreter is this one, so a missing extra is one
    line at submission rather than a failure in every task."""
    if options.doctor:
        return options
    lighthouse = slurm_live.lighthouse_of(
        cfg.recovery.live,
        cfg.recovery.lighthouse,
        cfg.recovery.rejoin,
        nodes=spec.nodes,
        ranks_per_node=spec.gpus_per_node,
        image=spec.image is not None,
    )
    if lighthouse and options.python is None and importlib.util.find_spec("torchft") is None:
        raise BadInput(
            "recovery.live=true needs torchft in the tasks' interpreter: pip install 'torchlaunch[live]' "
            "(make install-live), or set recovery.live=false"
        )
    return dataclasses.replace(options, lighthouse=lighthouse)


def elastic_parameters(spec: JobSpec, params: dict[str, Any]) -> dict[str, Any]:
    """submitit's executor parameters of an elastic spec (unchanged for a fixed node count).

    - sbatch --nodes=MIN-MAX, as an additional parameter: submitit's own `nodes` stays the MAX count (it
      multiplies it by the tasks per node to count its results, so a string there breaks submission), and
      an additional parameter replaces the same #SBATCH key, so the script says --nodes once.
    - No sbatch --ntasks-per-node: with it Slurm fixes the job's task count at MIN x tasks-per-node, and a
      node without a task is never allocated, so a 1-2 node job with one task per node always got one
      node (Slurm 22.05, measured on the dev cluster). The node's CPUs are asked for with --mincpus and the
      tasks are laid out by srun --ntasks-per-node, so the allocation is as many nodes as are up in
      MIN..MAX, also when Slurm requeues the job after a node failure (--requeue).
    """
    if spec.min_nodes is None:
        return params
    out = dict(params)
    per_node = int(out.pop("ntasks_per_node", spec.gpus_per_node))
    out["additional_parameters"] = {
        **out.get("additional_parameters", {}),
        "nodes": NodeRange(spec.min_nodes, spec.nodes).slurm(),
        "mincpus": per_node * (spec.cpus_per_task or 1),
    }
    out["srun_args"] = ["--ntasks-per-node", str(per_node), *out.get("srun_args", [])]
    return out


GRACE_TIME = re.compile(r"(?:^|\s)GraceTime=([0-9]+)(?:\s|$)")


def grace_time_of(scontrol_out: str) -> int | None:
    """GraceTime in `scontrol show partition NAME -o`'s line (seconds), when it is there and above 0."""
    found = GRACE_TIME.search(scontrol_out)
    return int(found[1]) if found and 0 < int(found[1]) < 10**7 else None


def partition_grace_s(partition: str | None, timeout_s: float = 10.0) -> int | None:
    """The partition's GraceTime, when scontrol answers; None where it cannot be read (then the --signal
    lead time alone is the worker's)."""
    if not partition or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "partition", partition, "-o"], capture_output=True, text=True, timeout=timeout_s
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return grace_time_of(out)


def node_cpus(partition: str | None, timeout_s: float = 10.0) -> int | None:
    """The most CPUs of one node (of `partition`), when sinfo answers; None when no cluster is reachable."""
    if shutil.which("sinfo") is None:
        return None
    argv = ["sinfo", "-h", "-o", "%c", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    counts = [int(c) for c in re.findall(r"\d+", out)]
    return max(counts) if counts else None


if __name__ == "__main__":
    sys.exit(main())
