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

This module is the command line and the submission (the run dir's lock, its config, sbatch through
submitit, `--wait`); the pure render (JobSpec -> executor parameters, sbatch script, the task's argv) is
torchlaunch.backends.slurm.render, the in-task runtime torchlaunch.backends.slurm.task, the cluster's
answers (sinfo, scontrol) torchlaunch.backends.slurm.cluster and following a job to its end
torchlaunch.backends.slurm.follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from torchlaunch import backends, roads, runlock
from torchlaunch import config as config_mod
from torchlaunch.backends.slurm import live as slurm_live
from torchlaunch.backends.slurm.cluster import (
    NO_SLURM_CONF,
    Partition,
    check_slurm_conf,
    cluster_partitions,
    default_partition,
    have,
    no_slurm_conf_message,
    node_cpus,
    partition_grace_s,
)
from torchlaunch.backends.slurm.follow import follow, rank0_log
from torchlaunch.backends.slurm.render import (
    SlurmOptions,
    doctor_recipe,
    executor_parameters,
    resolve_run_dir,
    sbatch_script,
    submitit_folder,
    task_argv,
    task_python,
)
from torchlaunch.backends.slurm.task import DEFAULT_MAX_TIMEOUTS, SlurmTask
from torchlaunch.exit_codes import FAILURE, OK, BadInput
from torchlaunch.jobs import record
from torchlaunch.launch import cli, precheck, shape
from torchlaunch.launch.spec import JobSpec

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
    """The rendered executor parameters and task, handed to the cluster (submit_task)."""
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
        heartbeat_timeout_ms=options.heartbeat_timeout_ms,
        live_minimum=slurm_live.minimum_env(spec.min_nodes, spec.nodes) if options.lighthouse else {},
    )
    return submit_task(submitit_folder(run_dir), task_python(spec, options), options.max_timeouts, parameters, task)


def submit_task(folder: str, python: str, max_timeouts: int, parameters: dict[str, Any], task: Any) -> Any:
    """sbatch through submitit: an executor with the rendered parameters, then the task's pickle."""
    import submitit

    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=max_timeouts, python=shlex.quote(python))
    executor.update_parameters(**parameters)
    return executor.submit(task)


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
    road = ""
    if not spec.program:
        cfg = config_mod.load(spec.config, spec.overrides)
        precheck.check(cfg, on_cpu=not options.use_gpus, local=False, doctor=options.doctor)
        options = with_live(options, cfg, spec)
        if not options.doctor:
            settle_config(cfg, args.reconfigure, write=False)  # refused before anything is written or printed
        if not options.doctor and spec.nodes * spec.gpus_per_node > 1:
            image = spec.image is not None and cfg.recovery.live is not False
            road = slurm_live.road_line(
                bool(options.lighthouse), slurm_live.IMAGE_WHY if image else roads.RESTART.WAY_OUT
            )
    elif not options.doctor and spec.nodes * spec.gpus_per_node > 1:
        road = slurm_live.road_line(False, roads.RESTART.PROGRAM_WHY)
    if args.dry_run:
        if road:
            print(road, file=sys.stderr, flush=True)  # stdout is the script
        print(sbatch_script(spec, options), end="")
        return OK
    if not have("sbatch"):
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
    if road:  # news once submitted, on stdout: a refusal before it stays bad input's one line on stderr
        print(road, flush=True)
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
    heartbeat_ms = round(cfg.recovery.heartbeat_timeout_s * 1000)
    return dataclasses.replace(options, lighthouse=lighthouse, heartbeat_timeout_ms=heartbeat_ms)


if __name__ == "__main__":
    sys.exit(main())
