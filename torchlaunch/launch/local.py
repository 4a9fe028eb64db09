"""Local launcher: JobSpec -> torchrun argv (pure), then run it and report the workers' exit code.
One worker without restarts runs directly, without torchrun's agent (see runs_without_agent).

    python -m launch.local --gpus 4 --config configs/cifar10.yaml optim.lr=0.2
    python -m launch.local --nnodes 2 --node-rank 1 --master-addr node0 --gpus 8 --config ...
    python -m launch.local --gpus 2 -- my_train.py --epochs 3     # any script: the default program
    python -m launch.local --gpus 2 -- -m my_pkg.train --lr 0.1   # is the built-in worker (-m torchlaunch.worker)

Every rank runs through torchlaunch.runner, the built-in worker (`-m torchlaunch.worker`, the default
program) exactly like a user's script, so both get the same env contract, signal forwarding, torchrun
restarts, exit codes 0/2/75/1, --dry-run and --doctor. The argv grammar, the program rule and the
pre-spawn policy are torchlaunch.launch.cli's. A user's ranks report to a private status folder
instead of RUN_DIR/status, since the launcher knows no run dir of a user's program.

Why torchrun runs as a child rather than via exec: torchrun exits 1 whatever its workers returned,
but schedulers need to tell "bad input, never retry" (2) and "preempted, run me again" (75) apart.
Workers leave their outcome in RUN_DIR/status/<attempt>-rank<r>.json and this process maps it back.
Signals (SIGTERM/SIGINT/SIGUSR1/SIGUSR2/SIGHUP) are forwarded to torchrun as SIGTERM, which forwards
them to every worker; the workers agree on a step, checkpoint once, and exit 75.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torchlaunch import config as config_mod
from torchlaunch import runner as program_mod
from torchlaunch import status
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED
from torchlaunch.launch import cli, precheck
from torchlaunch.launch.relay import StderrRelay
from torchlaunch.launch.spec import DEFAULT_MASTER_PORT, JobSpec

ATTEMPT_ENV = status.ATTEMPT_ENV
PREFLIGHT = program_mod.PREFLIGHT
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN_WORKER = program_mod.BUILTIN_WORKER  # the default program; never the top-level `train` a user may own
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@dataclass(frozen=True)
class NodePlacement:
    """Where this node sits in a multi-node job (ignored for a single node)."""

    node_rank: int = 0
    master_addr: str | None = None


def run_id(run_dir: str) -> str:
    """Stable rendezvous id: every node of the same run computes the same one."""
    return "tl-" + hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]


def program_id(program: Sequence[str], placement: NodePlacement, port: int) -> str:
    """Rendezvous id of a user's program: every node runs the same command line, so computes the same."""
    text = "\0".join([*program, placement.master_addr or "", str(port)])
    return "tl-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def program_tail(spec: JobSpec, module: str) -> list[str]:
    """What each rank runs, always through the one runner: the user's program, or the built-in
    `module` (the worker, or the pre-flight of --doctor) on the resolved config."""
    if spec.program and module == BUILTIN_WORKER:
        return ["-m", "torchlaunch.runner", *spec.program]
    return ["-m", "torchlaunch.runner", "-m", module, "--config", spec.config, *spec.overrides]


def torchrun_argv(
    spec: JobSpec,
    placement: NodePlacement,
    *,
    python: str = "python",
    module: str = BUILTIN_WORKER,
    rdzv_run_id: str | None = None,
) -> list[str]:
    """The exact torchrun command for one node of `spec` (pure: no environment, no files).
    launch.torchrun is torchrun minus its ~0.8 s interpreter teardown at exit."""
    argv = [
        python,
        "-m",
        "torchlaunch.launch.torchrun",
        "--nnodes",
        str(spec.nodes),
        "--nproc-per-node",
        str(spec.gpus_per_node),
        "--max-restarts",
        str(spec.max_restarts),
    ]
    if spec.nodes == 1 and placement.master_addr is None:
        argv.append("--standalone")  # private rendezvous on a free local port
    else:
        if placement.master_addr is None:
            raise cli.error("--master-addr is required with --nnodes > 1 (pass the host name or address of node 0)")
        is_host = "true" if placement.node_rank == 0 else "false"
        argv += [
            "--node-rank",
            str(placement.node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{placement.master_addr}:{spec.master_port}",
            "--rdzv-id",
            rdzv_run_id or "torchlaunch",
            "--rdzv-conf",
            f"is_host={is_host}",
        ]
    argv += program_tail(spec, module)
    return argv


def runs_without_agent(spec: JobSpec, placement: NodePlacement) -> bool:
    """One worker on one node with no restarts: torchrun's agent would only start it (its own torch
    import alone costs ~1.7 s on 2 cores), so the worker runs directly. It needs no rendezvous: with
    no RANK/WORLD_SIZE in its environment torchlaunch.contract finds no contract and it runs as a single process."""
    return spec.nodes == 1 and spec.gpus_per_node == 1 and spec.max_restarts == 0 and placement.master_addr is None


def worker_argv(spec: JobSpec, *, python: str = "python", module: str = BUILTIN_WORKER) -> list[str]:
    """The single worker's command when it runs without the agent (pure)."""
    return [python, *program_tail(spec, module)]


def launch_argv(spec: JobSpec, placement: NodePlacement, module: str, doctor: bool, rdzv_run_id: str) -> list[str]:
    """The command this launcher runs: the single worker itself when no agent is needed (never for the
    distributed pre-flight), else torchrun."""
    if runs_without_agent(spec, placement) and not doctor:
        return worker_argv(spec, python=sys.executable, module=module)
    return torchrun_argv(spec, placement, python=sys.executable, module=module, rdzv_run_id=rdzv_run_id)


def worker_threads(procs_per_node: int, cores: int) -> int:
    """OMP threads per worker so that workers x threads <= cores."""
    return max(1, cores // max(1, procs_per_node))


def launch_env(
    spec: JobSpec, base: dict[str, str], cores: int, attempt: str, status_folder: Path | None = None
) -> dict[str, str]:
    env = dict(base)
    if spec.program:
        # The runner (torchlaunch.runner) must import from any working directory; appended, so the
        # user's own packages of the same name (cwd or the script's folder come first) still win.
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(REPO_ROOT) not in paths:
            env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO_ROOT)])
    if status_folder is not None:
        env[status.STATUS_DIR_ENV] = str(status_folder)
    env.setdefault("OMP_NUM_THREADS", str(worker_threads(spec.gpus_per_node, cores)))
    # torch 2.14.1: restarts fail with stale addresses in a shared rendezvous store (pytorch#135712).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[ATTEMPT_ENV] = attempt
    return env


def combine_exit_codes(torchrun_code: int, worker_codes: Sequence[int], ranks: int | None = None) -> int:
    """The job's exit code from torchrun's and the workers' reports. When all `ranks` local ranks
    reported a finish, a non-zero torchrun code can only come from a rank's C++ teardown after its
    program ended (gloo sometimes aborts there): the run is done."""
    if torchrun_code == 0:
        return OK
    if ranks is not None and len(worker_codes) == ranks and all(c == OK for c in worker_codes):
        return OK
    if BAD_INPUT in worker_codes:
        return BAD_INPUT
    if PREEMPTED in worker_codes and FAILURE not in worker_codes:
        return PREEMPTED
    return FAILURE


def read_worker_codes(run_dir: Path, attempt: str) -> tuple[list[int], list[str]]:
    """The built-in worker's reports, left in RUN_DIR/status/ (consumed)."""
    return status.collect(Path(run_dir) / "status", attempt)


def visible_gpus() -> int:
    known = precheck.visible_gpus_without_torch()  # no torch import on machines without GPUs
    if known is not None:
        return known
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m launch.local",
        usage="%(prog)s [options] --config YAML [key=value ...] | "
        "[options] -- SCRIPT.py [args] | [options] -- -m MODULE [args]",
        description="Run DDP training with torchrun on this machine (CPU + gloo without GPUs): "
        "the built-in worker on a recipe, or any program after --.",
    )
    cli.add_common(
        p,
        config_help="recipe YAML of the built-in worker, e.g. configs/smoke.yaml (not with a program after --)",
        run_dir_help="with a program after --: the shared folder --doctor checks (default: a private temporary folder)",
    )
    p.add_argument("--gpus", type=int, default=1, help="worker processes on this node (one per GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes in the job")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (0 hosts the rendezvous)")
    p.add_argument("--master-addr", default=None, help="host name or address of node 0 (multi-node)")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, help="rendezvous port on node 0")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of the worker group")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: GPUs when visible, else CPU processes on gloo",
    )
    p.add_argument("--module", default=BUILTIN_WORKER, help=argparse.SUPPRESS)
    return cli.parse(p, argv)


def check_placement(args: argparse.Namespace) -> None:
    """The launcher's own numbers, whatever the program."""
    if args.gpus < 1:
        raise cli.error(f"--gpus must be >= 1, got {args.gpus} (GPUS=1 runs one worker)")
    if args.nnodes < 1:
        raise cli.error(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise cli.error(f"--node-rank {args.node_rank} outside 0..{args.nnodes - 1}")
    if args.max_restarts < 0:
        raise cli.error(f"--max-restarts must be >= 0, got {args.max_restarts}")


def check_devices(args: argparse.Namespace) -> None:
    if args.device != "cpu":
        gpus = visible_gpus()
        if args.device == "cuda" and gpus == 0:
            raise cli.error(
                "--device cuda but no GPU is visible (check the driver and CUDA_VISIBLE_DEVICES, or use --device cpu)"
            )
        if gpus and args.gpus > gpus:
            raise cli.error(
                f"GPUS={args.gpus} but only {gpus} GPU(s) are visible (use GPUS<={gpus} or check CUDA_VISIBLE_DEVICES)"
            )


@dataclass(frozen=True)
class Plan:
    """Everything checked, nothing started: what every rank of this node runs."""

    spec: JobSpec
    placement: NodePlacement
    cfg: config_mod.RunConfig | None
    """The built-in worker's resolved recipe; None with a user's program."""
    program: program_mod.Program | None


def plan(args: argparse.Namespace) -> Plan:
    """Validate everything before starting anything (the same in a run, --dry-run and --doctor);
    BadInput on the first problem."""
    check_placement(args)
    program = cli.check_program(args)
    placement = NodePlacement(args.node_rank, args.master_addr)
    common = {
        "nodes": args.nnodes,
        "gpus_per_node": args.gpus,
        "master_port": args.master_port,
        "max_restarts": args.max_restarts,
    }
    if program is not None:
        check_devices(args)
        spec = JobSpec(program=tuple(program.argv()), run_dir=args.run_dir, **common)
        return Plan(spec, placement, None, program)
    cfg = config_mod.load(args.config, args.overrides)
    check_devices(args)
    precheck.check(cfg, on_cpu=args.device == "cpu" or visible_gpus() == 0, local=True, doctor=args.doctor)
    spec = JobSpec(config=str(Path(cfg.run_dir) / "config.yaml"), run_dir=cfg.run_dir, **common)
    return Plan(spec, placement, cfg, None)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(lambda: launch(sys.argv[1:] if argv is None else argv))


def launch(argv: Sequence[str]) -> int:
    """Parse, plan, then print (--dry-run) or run the node's ranks; BadInput before anything starts."""
    args = parse_args(argv)
    planned = plan(args)
    if planned.program is not None:
        return launch_program(args, planned)
    cfg, spec = planned.cfg, planned.spec
    assert cfg is not None
    module = PREFLIGHT if args.doctor else args.module
    argv_out = launch_argv(spec, planned.placement, module, args.doctor, run_id(cfg.run_dir))
    if args.dry_run:
        print(shlex.join(argv_out))
        return OK
    config_mod.write_resolved(cfg)
    attempt = uuid.uuid4().hex[:12]
    env = launch_env(spec, dict(os.environ), available_cores(), attempt)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(f"launch: {shlex.join(argv_out)}", file=sys.stderr, flush=True)
    return run(argv_out, env, Path(cfg.run_dir) / "status", attempt, ranks=spec.gpus_per_node)


def doctor_config(private: Path, run_dir: str) -> str:
    """train.preflight reads a recipe; a user's program has none, so it gets the defaults, the
    synthetic data set (nothing to read) and the run dir to probe for shared storage."""
    path = private / "doctor.yaml"
    path.write_text(f"run_dir: {json.dumps(os.path.abspath(run_dir))}\ndata:\n  name: synthetic\n")
    return str(path)


def launch_program(args: argparse.Namespace, planned: Plan) -> int:
    """The same launch for a user's program: one rank each through the runner."""
    attempt = uuid.uuid4().hex[:12]
    private = Path(tempfile.gettempdir()) / f"torchlaunch-{attempt}"  # status records (+ doctor recipe)
    spec, placement, program = planned.spec, planned.placement, planned.program
    assert program is not None
    module = BUILTIN_WORKER
    if args.doctor:
        module = PREFLIGHT
        spec = spec.replace(config=str(private / "doctor.yaml"))
    argv_out = launch_argv(spec, placement, module, args.doctor, program_id(spec.program, placement, spec.master_port))
    if args.dry_run:
        print(shlex.join(argv_out))
        return OK
    private.mkdir(mode=0o700)
    try:
        if args.doctor:
            doctor_config(private, args.run_dir or str(private / "doctor-run"))
        env = launch_env(spec, dict(os.environ), available_cores(), attempt, status_folder=private)
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        print(f"launch: {shlex.join(argv_out)}", file=sys.stderr, flush=True)
        return run(
            argv_out, env, private, attempt, label="training" if args.doctor else program.name, ranks=spec.gpus_per_node
        )
    finally:
        shutil.rmtree(private, ignore_errors=True)


def run(
    argv: list[str],
    env: dict[str, str],
    status_folder: Path,
    attempt: str,
    label: str = "training",
    ranks: int | None = None,
) -> int:
    """Run torchrun, forward stop signals to it, and turn the workers' reports into one exit code."""
    env = {**env, status.STATUS_DIR_ENV: str(status_folder)}
    read_fd, write_fd = os.pipe()
    if sys.stderr.isatty():
        env = {**env, "TORCHLAUNCH_PROGRESS_BAR": "1"}  # workers see a pipe, the user a terminal
    child = subprocess.Popen(argv, env=env, stderr=write_fd)
    os.close(write_fd)
    relay = StderrRelay(read_fd, sys.stderr)
    forwarded = {"count": 0}

    def forward(signum: int, frame: object) -> None:
        forwarded["count"] += 1
        try:
            child.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        torchrun_code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.finish()
    codes, reasons = status.collect(status_folder, attempt)
    code = combine_exit_codes(torchrun_code, codes, ranks)
    if code == OK and torchrun_code != 0:
        print(
            f"launch: every rank reported a finish; exit {torchrun_code} came from a rank's teardown "
            f"after it (ignored)",
            file=sys.stderr,
        )
    if code == BAD_INPUT:
        reason = next((r for c, r in zip(codes, reasons, strict=True) if c == BAD_INPUT), "bad input")
        print(f"launch: workers stopped on bad input (exit 2, not retried): {reason}", file=sys.stderr)
    elif code == PREEMPTED:
        print(
            "launch: preempted with a committed checkpoint (exit 75); run the same command again to resume",
            file=sys.stderr,
        )
    elif code == FAILURE:
        relay.release_held()
        print(
            f"launch: {label} failed (torchrun exit {torchrun_code}, worker codes {sorted(set(codes)) or 'none'})",
            file=sys.stderr,
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
