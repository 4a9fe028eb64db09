"""The Slurm launcher's pure render: JobSpec -> the task's argv, submitit's executor parameters and the
sbatch script submitit would write (`launch.slurm --dry-run` prints it), without a cluster.

One task per GPU (or per CPU worker); each task runs its program in-process through torchlaunch.runner
(torchlaunch.backends.slurm.task). The batch shell passes stop signals on to srun (batch_shell_stop); a
live job adds its verdict and successor lines (backends.slurm.live); a node range asks for MIN-MAX nodes
(elastic_parameters). The command line and the submission are torchlaunch.backends.slurm.launch's.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch import compat, rankpath, rundir
from torchlaunch import runner as program_mod
from torchlaunch.backends.slurm import live as slurm_live
from torchlaunch.backends.slurm.sbatch import container_mount, sbatch_key, sbatch_nodes, sbatch_path, sbatch_value
from torchlaunch.backends.slurm.task import DEFAULT_MAX_TIMEOUTS
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import ranklog
from torchlaunch.launch import emit
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
    """Live recovery (recovery.live): the membership service's address, or backends.slurm.live.PLACED
    (the job's own nodes place it through the run dir); '' when the job is not live
    (backends.slurm.live.lighthouse_of decides)."""
    heartbeat_timeout_ms: int = 1000
    """recovery.heartbeat_timeout_s, for the placed service's Lighthouse and its lease (PLACED)."""
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
    return sbatch_path(os.path.abspath(run_dir), "--run-dir" if spec.program else "run_dir")


def _yaml_run_dir(config: str) -> str | None:
    from torchlaunch.base.yaml_file import read_yaml  # the one bounded reader of config files

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
        "job_name": sbatch_value(options.job_name, "--job-name"),
        "nodes": spec.nodes,
        "ntasks_per_node": spec.gpus_per_node,
        "time": spec.time_min,
        "signal_delay_s": spec.signal_delay_s,
        "setup": setup,
        # --requeue: the job stays eligible for requeue after preemption, node failure or our
        # own `scontrol requeue` even where the cluster sets JobRequeue=0.
        "additional_parameters": {
            "requeue": True,
            **{sbatch_key(k): sbatch_value(v, f"--sbatch {k}") for k, v in spec.extra.items()},
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
        {key: sbatch_value(value, f"--{key.replace('_', '-')}") for key, value in optional.items() if value is not None}
    )
    if spec.image:
        # pyxis: every task runs inside the image with the repo and the run dir mounted.
        emit.refuse_control(spec.image, "--image", "pass a single-line image name")
        mounts = ",".join(
            f"{path}:{path}"
            for path in (
                container_mount(options.repo_root, "the repository root"),
                container_mount(run_dir, "the run dir"),
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
        "nodes": sbatch_nodes(NodeRange(spec.min_nodes, spec.nodes)),
        "mincpus": per_node * (spec.cpus_per_task or 1),
    }
    out["srun_args"] = ["--ntasks-per-node", str(per_node), *out.get("srun_args", [])]
    return out
