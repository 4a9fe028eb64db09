"""Local launcher: JobSpec -> torchrun argv (pure), then run it and report the workers' exit code.
One worker without restarts runs directly, without torchrun's agent (see runs_without_agent).

    python -m launch.local --gpus 4 --config configs/cifar10.yaml optim.lr=0.2
    python -m launch.local --nnodes 2 --node-rank 1 --master-addr node0 --gpus 8 --config ...
    python -m launch.local --nnodes 1:2 --master-addr node0 --max-restarts 3 --config ...  # elastic (launch.elastic)
    python -m launch.local --nnodes 1:2 --node-rank 1 --master-addr node0 --config ... recovery.live=true \
        recovery.lighthouse=http://lh:29510   # live: the first group of the nodes in time (first_group.py)
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
them to every worker; the workers agree on a step, checkpoint once, and exit 75. After such a
signal a rank that ends 0 without its program declaring the run finished counts as 75 (see
torchlaunch.status), so a framework that saves and exits 0 on SIGTERM is run again, not called done.
torchrun's and accelerate's option spellings are accepted (torchlaunch.launch.cli.ALIASES), and a
single worker without the agent sees the same env contract as torchrun's workers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from torchlaunch import config as config_mod
from torchlaunch import contract, exit_codes, grace, pdeath, rankpath, rundir, runlock, status
from torchlaunch import runner as program_mod
from torchlaunch.backends import lighthouse_reach
from torchlaunch.backends.local import first_group
from torchlaunch.base import procs as ops_procs
from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED
from torchlaunch.jobs import record, watchdog
from torchlaunch.jobs.launcher import Operation
from torchlaunch.jobs.lost import lost_by_stop, lost_line
from torchlaunch.jobs.progress import RankBeat
from torchlaunch.launch import cli, elastic, emit, finished, precheck, shape
from torchlaunch.launch.relay import StderrRelay
from torchlaunch.launch.spec import DEFAULT_MASTER_PORT, JobSpec

if TYPE_CHECKING:
    from torchlaunch.core.recovery.fence import Fence  # live mode only: imported where used

ATTEMPT_ENV = status.ATTEMPT_ENV
PREFLIGHT = program_mod.PREFLIGHT
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN_WORKER = program_mod.BUILTIN_WORKER  # the default program; never the top-level `train` a user may own
FORWARDED_SIGNALS = program_mod.PREEMPTION_SIGNALS
TORCHRUN_ENV = contract.TORCHRUN_ENV


@dataclass(frozen=True)
class NodePlacement:
    """Where this node sits in a multi-node job (ignored for a single node)."""

    node_rank: int = 0
    master_addr: str | None = None
    rdzv_conf: tuple[tuple[str, int], ...] = ()
    """Elastic jobs: torchrun's rendezvous timeouts (launch.elastic.parse_rdzv_conf)."""


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
        return ["-m", "torchlaunch.runner", *emit.argv_items(spec.program, "program argument")]
    return [
        "-m",
        "torchlaunch.runner",
        "-m",
        module,
        "--config",
        emit.argv_item(not_an_option(spec.config), "--config"),
        *emit.argv_items(spec.overrides, "override"),
    ]


def not_an_option(path: str) -> str:
    """A relative path that starts with `-` (run_dir=-run) as `./-run`: never read as an option."""
    return f"./{path}" if path.startswith("-") else path


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
    if spec.min_nodes is not None:
        if placement.master_addr is None:
            raise cli.error("--master-addr is required with --nnodes MIN:MAX (the host of the rendezvous store)")
        argv[argv.index("--nnodes") + 1] = shape.NodeRange(spec.min_nodes, spec.nodes).torchrun()
        argv += elastic.torchrun_rendezvous(
            shape.NodeRange(spec.min_nodes, spec.nodes),
            placement.master_addr,
            spec.master_port,
            rdzv_run_id or "torchlaunch",
            placement.rdzv_conf,
        )
    elif spec.nodes == 1 and placement.master_addr is None:
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
    import alone costs ~1.7 s on 2 cores), so the worker runs directly, with torchrun's env contract set
    by this launcher (single_worker_env); a one-rank contract builds no process group (core.dist)."""
    return (
        spec.nodes == 1
        and spec.min_nodes is None
        and spec.gpus_per_node == 1
        and spec.max_restarts == 0
        and placement.master_addr is None
    )


def worker_argv(spec: JobSpec, *, python: str = "python", module: str = BUILTIN_WORKER) -> list[str]:
    """The single worker's command when it runs without the agent (pure)."""
    return [python, *program_tail(spec, module)]


def launch_argv(spec: JobSpec, placement: NodePlacement, module: str, doctor: bool, rdzv_run_id: str) -> list[str]:
    """The command this launcher runs: the single worker itself when no agent is needed (never for the
    distributed pre-flight), else torchrun."""
    if runs_without_agent(spec, placement) and not doctor:
        return worker_argv(spec, python=sys.executable, module=module)
    return torchrun_argv(spec, placement, python=sys.executable, module=module, rdzv_run_id=rdzv_run_id)


def live_mode(cfg: config_mod.RunConfig, spec: JobSpec, placement: NodePlacement, doctor: bool) -> bool:
    """Whether this launch runs its ranks under the live agent (recovery.live, several ranks in all).
    Across nodes (--nnodes N, or MIN:MAX: first_group.py) the agents place the membership service on
    one of the job's nodes through the run dir (core/recovery/placement.py), unless recovery.lighthouse
    names one of the user's own."""
    if not cfg.recovery.live or doctor:
        return False
    return spec.nodes * spec.gpus_per_node > 1


def require_live_extra() -> None:
    """Live mode's membership service is torchft's: one line before anything starts when it is missing."""
    if importlib.util.find_spec("torchft") is None:
        raise cli.error(
            "recovery.live=true needs torchft (the membership service): pip install 'torchlaunch[live]' "
            "(make install-live), or set recovery.live=false"
        )


def live_argv(
    spec: JobSpec,
    heartbeat_timeout_s: float,
    rdzv_run_id: str,
    *,
    python: str = "python",
    rejoin: int = 0,
    placement: NodePlacement | None = None,
    lighthouse: str = "",
    join_attempt: int = 0,
    first: first_group.FirstSeat | None = None,
) -> list[str]:
    """The live agent's command (torchlaunch.backends.local.live), pure: this node's ranks, which regroup
    in place when one is lost, and on one node the membership service beside them; across nodes, where
    node 0 is (the first group's store) and the service apart (`lighthouse`), and for a node that
    replaces a lost one, the attempt its ranks join the training group with (replaces_a_lost_node).
    With --nnodes MIN:MAX, the range (MIN goes to the ranks) and, once the nodes met (`first`), this
    node's seat in the first group, whose store is on its first node; without it (--dry-run: nobody
    met) the agent starts a first group of every node."""
    placement = placement or NodePlacement()
    across = ["--lighthouse", lighthouse] if lighthouse else []
    if not lighthouse and (spec.nodes > 1 or placement.master_addr is not None):
        across = ["--run-dir", spec.run_dir or ""]  # the agents place the service (core/recovery/placement.py)
    if join_attempt:
        across += ["--join-attempt", str(join_attempt)]
    if spec.nodes > 1 or placement.master_addr is not None:
        nodes = shape.NodeRange(spec.min_nodes or spec.nodes, spec.nodes)
        across += [
            "--nnodes",
            nodes.torchrun(),
            "--node-rank",
            str(placement.node_rank),
            "--master-addr",
            first.master_host if first is not None else placement.master_addr or "127.0.0.1",
            "--master-port",
            str(spec.master_port),
        ]
        if first is not None and not join_attempt:
            across += ["--first-seat", str(first.seat), "--first-nodes", str(first.nodes)]
    return [
        python,
        "-m",
        "torchlaunch.backends.local.live",
        "--nproc",
        str(spec.gpus_per_node),
        "--heartbeat-timeout-ms",
        str(round(heartbeat_timeout_s * 1000)),
        "--run-id",
        rdzv_run_id,
        "--rejoin",
        str(rejoin),
        *across,
        "--",
        *program_tail(spec, BUILTIN_WORKER),
    ]


def live_options(cfg: config_mod.RunConfig, placement: NodePlacement) -> dict[str, Any]:
    return {
        "python": sys.executable,
        "rejoin": cfg.recovery.rejoin,
        "placement": placement,
        "lighthouse": cfg.recovery.lighthouse,
    }


def replaces_a_lost_node(lock: runlock.RunLock | None, run_dir: str) -> int:
    """0 when this node's launcher starts the live job's ranks with the others; else the attempt number
    its ranks join a group that trains already with (a new launch of a lost node's command: a pod the
    Job replaced, a node started again by hand). The launcher that founds the job's run (no launcher of
    the job alive: runlock) records the run dir's group generation; one that joins later replaces a
    lost node once a group formed since (core/recovery/fence.py). The attempt is past every generation,
    so its ranks' ids differ from the lost node's. Only a launch across nodes shares the lock by job."""
    if lock is None or lock.slot is None:
        return 0
    from torchlaunch.core.recovery.fence import Fence  # live mode across nodes only: no import otherwise

    fence = Fence(run_dir)
    if lock.founded or not founder_recorded(lock, fence):
        fence.found(lock.holder.incarnation)
        return 0
    return fence.current() + 1 if fence.formed_since_founded() else 0


FOUNDER_WAIT_S = 30.0
"""How long a joining launcher waits for its founder's record (written once the founder's config is
settled: milliseconds to seconds after it took the run dir)."""


def founder_recorded(lock: runlock.RunLock, fence: Fence, wait_s: float = FOUNDER_WAIT_S) -> bool:
    """Whether the founded record is this run's (its incarnation: runlock.Holder.incarnation), waiting
    for it while the founder is alive. The founder records after settling its config (a refused launch
    writes nothing), so a launcher that joins at once could otherwise read an earlier run's record,
    whose generation that run's groups grew past, and take itself for a lost node's replacement. False
    when the founder left without recording (its ranks never started, so no group of this run formed)
    or stays silent past `wait_s`: this launcher's ranks start with the others."""
    deadline = time.monotonic() + wait_s
    while fence.founder() != lock.holder.incarnation:
        alive = {member.token for member in lock.live_members(lock.holder.job or "")}
        if lock.holder.incarnation not in alive or time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # the founder's record lands within its config's settling
    return True


class LaunchEnded(Exception):
    """The launch ends before its ranks start, with `code` and one line (a stop, no first group)."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code, self.line = code, line


def live_start(
    lock: runlock.RunLock | None, cfg: config_mod.RunConfig, spec: JobSpec, placement: NodePlacement
) -> tuple[int, first_group.FirstSeat | None]:
    """How this node's ranks start in live mode: (the attempt they join a training group with, 0 for a
    first launch; their seat in the first group of a --nnodes MIN:MAX launch, None otherwise)."""
    if spec.min_nodes is None:
        joins = replaces_a_lost_node(lock, cfg.run_dir)
        if joins:
            say(
                "launch: this job trains already on its other nodes: this node's ranks join its live group "
                "with a peer's state"
            )
        return joins, None
    return meet_first_group(lock, cfg, spec, placement)


def road_line(live: bool) -> str:
    """The one line that says which road a multi-rank run of the built-in worker takes."""
    if live:
        return "launch: road: live (a lost rank or node costs a regroup in place; recovery.live=false: the restart)"
    return (
        "launch: road: restart (recovery.live=false): a lost rank stops every rank; torchrun's --max-restarts or "
        "the same command again resumes from the newest checkpoint"
    )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def meet_first_group(
    lock: runlock.RunLock | None, cfg: config_mod.RunConfig, spec: JobSpec, placement: NodePlacement
) -> tuple[int, first_group.FirstSeat | None]:
    """--nnodes MIN:MAX in live mode: wait in the run dir for the first group (first_group.py) and say
    where this node stands in it. The window after MIN nodes is the elastic rendezvous's last call
    (--rdzv-conf last_call_timeout, 10 s by default); the wait for MIN nodes its join_timeout (600 s)."""
    from torchlaunch.backends import live_shared
    from torchlaunch.core.recovery.fence import Fence

    assert lock is not None and lock.holder.job and placement.master_addr is not None  # check_nodes, elastic_job
    nodes = shape.NodeRange(spec.min_nodes or spec.nodes, spec.nodes)
    conf = dict(placement.rdzv_conf)
    host = live_shared.store_host(spec.nodes, placement.master_addr, cfg.recovery.lighthouse)
    me = first_group.Arrival(placement.node_rank, host, lock.holder.token, time.time())
    fence = Fence(cfg.run_dir)
    job = lock.holder.job

    def live_tokens() -> set[str]:
        return {m.token for m in lock.live_members(job)}

    meeting = first_group.Meeting(rundir.live(cfg.run_dir), me, live_tokens, fence.current)
    stopped = lambda: bool(_EARLY_SIGNALS)  # noqa: E731 - a stop while waiting: nothing trained here
    spelled = f"--nnodes {nodes.torchrun()}"
    try:
        met = meeting.meet(
            nodes, conf.get("last_call_timeout", 10), conf.get("join_timeout", first_group.JOIN_TIMEOUT_S), stopped
        )
    except TimeoutError as e:
        raise LaunchEnded(FAILURE, f"no first live group of {spelled}: {e}; nothing trained (exit 1)") from None
    if met is None:
        name = signal.Signals(_EARLY_SIGNALS[0]).name
        raise LaunchEnded(
            PREEMPTED, f"{name} while waiting for the first group of {spelled}: nothing to save (exit 75)"
        )
    listed = ", ".join(str(n) for n in met.node_ranks)
    if isinstance(met, first_group.FirstSeat):
        say(f"launch: the first live group of {spelled} is node(s) {listed}; this node's ranks start in it")
        return 0, met
    meeting.wait_formed(met, cfg.recovery.quorum_timeout_s, stopped)
    say(
        f"launch: the first live group of {spelled} formed without this node (node(s) {listed}): this node's "
        "ranks join it with a peer's state"
    )
    return fence.current() + 1, None


def numbered(args: argparse.Namespace, placement: NodePlacement, lock: runlock.RunLock | None) -> NodePlacement:
    """A live --nnodes MIN:MAX node launched without --node-rank takes its number from the run dir: its
    launcher's node slot (runlock: the lowest slot no live launcher of the job holds, created O_EXCL), as
    torchrun's elastic launch numbers nodes without being told."""
    if args.node_rank_given or lock is None or lock.slot is None or not args.node_range.elastic:
        return placement
    if lock.slot >= args.nnodes:
        raise LaunchEnded(  # 1, retryable: a lost node's slot frees once its lock does (NFS: the server's lease)
            FAILURE,
            f"--nnodes {args.node_range.torchrun()}: every node number of this job is held by a launcher "
            "(a lost node's is freed with its lock); nothing started (exit 1, retryable), or give --node-rank",
        )
    say(f"launch: this node is node {lock.slot} of --nnodes {args.node_range.torchrun()} (its slot in the run dir)")
    return dataclasses.replace(placement, node_rank=lock.slot)


def rendezvous_id(spec: JobSpec, placement: NodePlacement) -> str:
    """Every node of one job computes the same id: from the run dir for the built-in worker, from the
    program and its placement for a user's program."""
    return program_id(spec.program, placement, spec.master_port) if spec.program else run_id(spec.run_dir or "")


def render(spec: JobSpec, placement: NodePlacement, module: str = BUILTIN_WORKER, doctor: bool = False) -> list[str]:
    """The node's command for `spec` (pure: the --dry-run line, schedulers.local's render)."""
    return launch_argv(spec, placement, module, doctor, rendezvous_id(spec, placement))


def worker_threads(procs_per_node: int, cores: int) -> int:
    """OMP threads per worker so that workers x threads <= cores."""
    return max(1, cores // max(1, procs_per_node))


def launch_env(
    spec: JobSpec, base: dict[str, str], cores: int, attempt: str, status_folder: Path | None = None
) -> dict[str, str]:
    env = dict(base)
    if spec.program:
        # The runner must import from any working directory; only torchlaunch, never the project's
        # other folders (tests, bench, ...), which would shadow the user's packages of the same name.
        env["PYTHONPATH"] = rankpath.pythonpath(env.get("PYTHONPATH"))
    if status_folder is not None:
        env[status.STATUS_DIR_ENV] = str(status_folder)
    env.setdefault("OMP_NUM_THREADS", str(worker_threads(spec.gpus_per_node, cores)))
    # torch 2.14.1: restarts fail with stale addresses in a shared rendezvous store (pytorch#135712).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[ATTEMPT_ENV] = attempt
    return env


combine_exit_codes = exit_codes.node_code


def read_worker_codes(run_dir: Path, attempt: str) -> tuple[list[int], list[str]]:
    """The built-in worker's reports, left in RUN_DIR/status/ (consumed)."""
    return status.collect(rundir.status(run_dir), attempt)


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
    p = cli.Parser(
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
    shape.add(p, "gpus", default=1)
    shape.add(
        p,
        "nnodes",
        default="1",
        help="number of nodes in the job, or MIN:MAX: elastic, goes on with the nodes left when one is lost",
    )
    p.add_argument("--node-rank", type=int, default=None, help="this node's index (0 hosts the rendezvous)")
    p.add_argument(
        "--rdzv-conf",
        default=None,
        metavar="K=V,...",
        help="elastic rendezvous timeouts (default "
        + ",".join(f"{k}={v}" for k, v in elastic.DEFAULT_RDZV.items())
        + "): "
        + "; ".join(f"{k}: {v}" for k, v in elastic.RDZV_KEYS.items()),
    )
    p.add_argument("--master-addr", default=None, help="host name or address of node 0 (multi-node)")
    shape.add(p, "master_port", default=DEFAULT_MASTER_PORT)
    shape.add(
        p,
        "master_wait_s",
        default=0,
        help="wait up to S seconds for --master-addr to resolve where this launcher looks it up (a scheduler "
        "that starts nodes in any order: node 0's name may have no record yet); then exit 1. 0 (default): "
        "a name that does not resolve is refused at once (exit 2)",
    )
    shape.add(p, "max_restarts", default=0)
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: GPUs when visible, else CPU processes on gloo",
    )
    cli.add_reconfigure(p)
    cli.add_operation(
        p,
        hang_help="end the ranks (exit 1, retryable) when none progressed for S seconds; 0 disables "
        "(default: max(10 min, 50 x the median step time), armed once a rank reports a step)",
    )
    return cli.parse(p, argv)


def check_placement(args: argparse.Namespace) -> None:
    """The launcher's own numbers, whatever the program."""
    shape.check(args)
    check_nodes(args)
    args.nnodes = args.node_range.max
    args.node_rank_given = args.node_rank is not None
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    if not 0 <= args.node_rank < args.nnodes:
        raise cli.error(f"--node-rank {args.node_rank} outside 0..{args.nnodes - 1}")


def check_nodes(args: argparse.Namespace) -> None:
    """--nnodes N or MIN:MAX (parsed by shape.check), and what only one of them takes; what depends on
    live mode (known once the recipe is read) is check_range's."""
    nodes = args.node_range
    args.rdzv = elastic.parse_rdzv_conf(args.rdzv_conf, elastic.DEFAULT_RDZV) if nodes.elastic else ()
    if nodes.elastic:
        if args.master_addr is None:
            raise cli.error(
                f"--nnodes {nodes.torchrun()} needs --master-addr HOST (the host of the rendezvous store; "
                "127.0.0.1 for several launchers on this machine)"
            )
    elif args.rdzv_conf:
        raise cli.error(f"--rdzv-conf is for elastic jobs (--nnodes MIN:MAX), not --nnodes {nodes.max}")


LIVE_RDZV_KEYS = ("join_timeout", "last_call_timeout")
"""The --rdzv-conf keys live mode's first group uses (first_group.py); the others time torchrun's
rendezvous, which live mode has none of after the first group (a lost node is the live group's)."""


def check_range(args: argparse.Namespace, live: bool) -> None:
    """--nnodes MIN:MAX, once the launch's mode is known (pure over args). Under torchrun (elastic) the
    rendezvous numbers the nodes and a lost node costs a restart; in live mode (recovery.live) each node
    gives its own --node-rank (its ranks' files and ids follow it), a lost node costs no restart, and
    only the first group's timeouts apply."""
    nodes = args.node_range
    if not nodes.elastic:
        return
    spelled = nodes.torchrun()
    if not live:
        if args.node_rank_given:
            raise cli.error(
                f"--node-rank with --nnodes {spelled}: node ranks come from the rendezvous; drop --node-rank"
            )
        if args.max_restarts == 0:
            raise cli.error(
                f"--nnodes {spelled} with --max-restarts 0: a lost node costs one torchrun restart, so "
                "the job would end with it; pass --max-restarts K (e.g. 3)"
            )
        return
    for key, _ in elastic.parse_rdzv_conf(args.rdzv_conf):
        if key not in LIVE_RDZV_KEYS:
            raise cli.error(
                f"--rdzv-conf {key}: recovery.live=true has no torchrun rendezvous after its first group (a lost "
                f"node is judged by recovery.heartbeat_timeout_s); its keys are {' and '.join(LIVE_RDZV_KEYS)}"
            )


def check_rendezvous(args: argparse.Namespace) -> None:
    """Multi-node: node 0's address resolves (bounded), and node 0 can bind the port it will host.
    Not in --dry-run: the command printed may be meant for other machines than this one."""
    if args.dry_run or (args.nnodes == 1 and args.master_addr is None):
        return
    if args.master_addr is not None:
        resolve_master_addr(args.master_addr, args.master_wait_s)
    if args.node_rank == 0 and not args.node_range.elastic:  # elastic: the first launcher there binds it
        shape.bindable("--master-port", args.master_port)


MASTER_WAIT_MAX_S = shape.OPTIONS["master_wait_s"].high
"""--master-wait-s's bound (a week): a scheduler starts a job's nodes within minutes; more is a typo."""
MASTER_POLL_S = 1.0
"""How often a waiting launcher asks again for --master-addr (a DNS record appears within seconds of
its pod's IP)."""


def resolve_master_addr(addr: str, wait_s: int) -> None:
    """--master-addr resolves (shape.master_addr's look-up, bounded). wait_s 0: a name that does not is bad
    input at once (one line, exit 2). wait_s > 0 (--master-wait-s, where nodes start in any order, e.g.
    launch.k8s's live pods): a name that does not resolve *yet* (node 0 not started, its DNS record not
    there) is asked again every MASTER_POLL_S until wait_s has passed, then LaunchEnded, exit 1: by then it
    is node 0 or DNS that is missing, not the input (the form was checked at once, before the wait), and a
    retry is right (on Kubernetes within the index's budget, as the service's --wait-for). A stop signal
    while waiting ends it with exit 75 (nothing started, nothing to save)."""
    if wait_s <= 0:
        shape.master_addr("--master-addr", addr)
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:  # each look-up bounded as without a wait; the last one at the deadline
            shape.master_addr("--master-addr", addr, timeout_s=min(shape.RESOLVE_TIMEOUT_S, wait_s))
            return
        except exit_codes.BadInput:
            pass  # not yet: asked again below
        if _EARLY_SIGNALS:
            name = signal.Signals(_EARLY_SIGNALS[0]).name
            raise LaunchEnded(
                PREEMPTED,
                f"{name} while waiting for --master-addr {quote(addr, 80)} to resolve: nothing to save (exit 75)",
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchEnded(
                FAILURE,
                f"--master-addr {quote(addr, 80)} still does not resolve after --master-wait-s {wait_s}: is node 0 "
                "started, and its name right? nothing started here (exit 1, retryable)",
            )
        time.sleep(min(MASTER_POLL_S, left))  # a name appearing in DNS is no event this launcher can wait on


def check_address_form(args: argparse.Namespace) -> None:
    """--master-addr is a host name or address (shape.master_addr's first check, its one line), without
    resolving it: what every launch checks before anything, whether it needs node 0 or not."""
    if args.master_addr is not None and not shape.HOST.fullmatch(args.master_addr):
        shape.master_addr("--master-addr", args.master_addr)  # refuses the form before any lookup


def meets_at_node_0_first(args: argparse.Namespace, cfg: config_mod.RunConfig) -> bool:
    """A live launch across a fixed --nnodes N (pure over args and the recipe): only its first group meets
    at node 0 (its store at --master-addr:--master-port). A launcher that replaces a lost node
    (replaces_a_lost_node) joins through the membership service and a live peer's store, and node 0 may
    be the node lost, its name gone with it (a Kubernetes pod's DNS record goes with the pod): so
    check_rendezvous's lookup and port check wait until the launcher knows it starts in the first group
    (check_first_group), instead of refusing a replacement with exit 2. A range (MIN:MAX) meets in the
    run dir and is checked at once, as every other launch."""
    return (
        cfg.recovery.live
        and not args.doctor
        and args.nnodes > 1
        and not args.node_range.elastic
        and args.master_addr is not None
    )


def joins_a_live_group(lock: runlock.RunLock | None, run_dir: str) -> bool:
    """Whether this launcher, holding its job's lock, will start its ranks as joiners of a group that
    trains already (replaces_a_lost_node's answer, read without waiting or writing: a founder that has
    not recorded its run yet formed no group, so a launcher that arrives then starts in the first one)."""
    if lock is None or lock.slot is None or lock.founded:
        return False
    from torchlaunch.core.recovery.fence import Fence  # live mode across nodes only

    fence = Fence(run_dir)
    return fence.founder() == lock.holder.incarnation and fence.formed_since_founded()


def check_first_group(args: argparse.Namespace, lock: runlock.RunLock | None, run_dir: str) -> None:
    """check_rendezvous for a launch that meets_at_node_0_first, once it holds the job's lock: a launcher
    that starts in the first group needs node 0's name to resolve (and node 0 its port), bad input
    otherwise (one line, exit 2, before its config is settled or anything recorded in RUN_DIR/live), or,
    with --master-wait-s (nodes started in any order), it waits for the name first (resolve_master_addr);
    one that replaces a lost node needs neither, and never waits."""
    if not joins_a_live_group(lock, run_dir):
        check_rendezvous(args)


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
    if (args.device == "cpu" or visible_gpus() == 0) and args.gpus > (cap := shape.cpu_worker_cap()):
        raise cli.error(
            f"--gpus {args.gpus} CPU workers on a machine that runs at most {cap} (4 per usable core; "
            f"use --gpus {min(cap, 4)})"
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
    check_address_form(args)
    program = cli.check_program(args)
    placement = NodePlacement(args.node_rank, args.master_addr, args.rdzv)
    common = {
        "nodes": args.nnodes,
        "min_nodes": args.node_range.min if args.node_range.elastic else None,
        "gpus_per_node": args.gpus,
        "master_port": args.master_port,
        "max_restarts": args.max_restarts,
    }
    if program is not None:
        check_rendezvous(args)
        check_range(args, live=False)  # live mode is the built-in worker's
        if args.reconfigure:
            raise cli.error(
                "--reconfigure changes the built-in worker's RUN_DIR/config.yaml; a program after -- has none"
            )
        check_devices(args)
        spec = JobSpec(program=tuple(program.argv()), run_dir=args.run_dir, **common)
        return Plan(spec, placement, None, program)
    cfg = config_mod.load(args.config, args.overrides)
    if not meets_at_node_0_first(args, cfg):  # else once the lock says whether it starts the first group
        check_rendezvous(args)
    check_range(args, live=cfg.recovery.live)
    check_devices(args)
    precheck.check(cfg, on_cpu=args.device == "cpu" or visible_gpus() == 0, local=True, doctor=args.doctor)
    recipe = rundir.doctor_config(cfg.run_dir) if args.doctor else rundir.config(cfg.run_dir)
    spec = JobSpec(config=str(recipe), run_dir=cfg.run_dir, **common)
    return Plan(spec, placement, cfg, None)


_EARLY_SIGNALS: list[int] = []
"""Stop signals that arrived before the child existed: a scheduler may stop the job while this
launcher is still planning; that is a preemption (75, run me again), not a crash of the launcher."""


def _note_early_signal(signum: int, frame: object) -> None:
    _EARLY_SIGNALS.append(signum)


def main(argv: Sequence[str] | None = None) -> int:
    previous = {sig: signal.signal(sig, _note_early_signal) for sig in FORWARDED_SIGNALS}
    try:
        return cli.main(lambda: launch(sys.argv[1:] if argv is None else argv))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def free_port() -> int:
    """A port nobody listens on now, for the single worker's MASTER_PORT (torchrun --standalone picks one too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


single_worker_env = contract.single_worker_env


def contract_env(env: dict[str, str], agent: bool, rdzv_run_id: str) -> dict[str, str]:
    """The ranks' env contract: a stale one in the launcher's own environment never leaks into them;
    torchrun's agent sets it for its workers, this launcher for the single worker it starts itself."""
    clean = {k: v for k, v in env.items() if k not in TORCHRUN_ENV and k != pdeath.LAUNCHER_PID_ENV}
    if agent:
        return {**clean, **pdeath.launcher_env()}
    return {**clean, **single_worker_env(rdzv_run_id, free_port())}


def operation(
    args: argparse.Namespace, run_dir: str | Path, attempt: str, ranks: int, lock: runlock.RunLock | None = None
) -> Operation:
    """What makes this node's launch operable (status, logs, cancel, the hang watchdog): E's ops blocks.
    An elastic launcher's job record is named by its node slot in the run-dir lock (its rank is the
    rendezvous's, and changes with the group)."""
    scheduler, job_id, extra = record.scheduler_from_env(os.environ)
    node = lock.slot if lock is not None and lock.slot is not None else args.node_rank
    if lock is not None and lock.holder.job:  # one job of several launchers: status and cancel see them all
        extra = {**(extra or {}), record.ELASTIC_JOB: lock.holder.job}
    return Operation(
        run_dir,
        scheduler=scheduler,
        command=list(sys.argv),
        launch_id=attempt,
        job_id=job_id,
        node_rank=node,
        nnodes=args.nnodes,
        local_ranks=ranks,
        hang_timeout=args.hang_timeout,
        console=cli.console_of(args),
        extra=extra or None,
    )


@contextlib.contextmanager
def owned(run_dir: str | None, placement: NodePlacement, job: str | None = None) -> Iterator[runlock.RunLock | None]:
    """Node 0 owns the run dir for the launch (the other nodes join its job); taken before anything is
    written there. A live holder is bad input: one line naming it (cli.main prints it, exit 2). An elastic
    job (`job`, launch.elastic.job_key) has no node 0: every node's launcher joins the job's lock. A folder
    of the run dir linked elsewhere is refused first, on every node (rundir.check_folders)."""
    lock = None
    if run_dir:  # every node writes there (job record, logs, heartbeats), node 0 or not
        rundir.check_folders(run_dir)
    if run_dir and job is not None:
        lock = runlock.acquire(run_dir, command=list(sys.argv), job=job)
    elif run_dir and placement.node_rank == 0:
        lock = runlock.acquire(run_dir, command=list(sys.argv))
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def launch(argv: Sequence[str]) -> int:
    """Parse, plan, then print (--dry-run) or run the node's ranks; BadInput before anything starts."""
    args = parse_args(argv)
    try:
        planned = plan(args)
    except LaunchEnded as ended:  # --master-wait-s ran out (exit 1) or a stop came while it waited (75)
        print(f"launch: {ended.line}", file=sys.stderr, flush=True)
        return ended.code
    if planned.program is not None:
        return launch_program(args, planned)
    cfg, spec = planned.cfg, planned.spec
    assert cfg is not None
    module = PREFLIGHT if args.doctor else BUILTIN_WORKER
    rdzv = rendezvous_id(spec, planned.placement)
    live = live_mode(cfg, spec, planned.placement, args.doctor)
    if live:
        require_live_extra()
        if cfg.recovery.lighthouse and not args.dry_run:  # one bounded look, not a traceback per rank
            lighthouse_reach.check(cfg.recovery.lighthouse)
    if args.dry_run:
        if not args.doctor:  # the refusal a launch would make, nothing written
            config_mod.settle_resolved(cfg, reconfigure=args.reconfigure, write=False)
        typed = as_typed(spec, args)
        shown = (
            live_argv(typed, cfg.recovery.heartbeat_timeout_s, rdzv, **live_options(cfg, planned.placement))
            if live
            else render(typed, planned.placement, module, args.doctor)
        )
        print(shlex.join(shown))
        return OK
    argv_out = [] if live else render(spec, planned.placement, module, args.doctor)
    with owned(cfg.run_dir, planned.placement, elastic_job(spec, planned.placement, rdzv, live)) as lock:
        if meets_at_node_0_first(args, cfg):
            try:
                check_first_group(args, lock, cfg.run_dir)
            except LaunchEnded as ended:  # as above: nothing settled, nothing recorded
                print(f"launch: {ended.line}", file=sys.stderr, flush=True)
                return ended.code
        if args.doctor:  # checks this launch's config; the run's own is never rewritten by a pre-flight
            settled = config_mod.Settled(config_mod.write_resolved(cfg, rundir.doctor_config(cfg.run_dir)))
        else:
            settled = settle_config(cfg, args.reconfigure, lock)
        one_node = spec.nodes == 1 and spec.min_nodes is None and planned.placement.master_addr is None
        changed = args.doctor or settled.previous is not None or settled.note is not None
        if finished.already(cfg.run_dir, changed=changed, one_node=one_node):
            return OK  # torchlaunch.launch.finished: nothing started, nothing written
        if live:  # after the config is settled: a refused launch records nothing in RUN_DIR/live
            try:
                placement = numbered(args, planned.placement, lock)
                joins, first = live_start(lock, cfg, spec, placement)
            except LaunchEnded as ended:
                print(f"launch: {ended.line}", file=sys.stderr, flush=True)
                return ended.code
            options = live_options(cfg, placement)
            argv_out = live_argv(
                spec, cfg.recovery.heartbeat_timeout_s, rdzv, **options, join_attempt=joins, first=first
            )
        attempt = uuid.uuid4().hex[:12]
        agent = uses_agent(spec, planned.placement, args.doctor)
        env = contract_env(launch_env(spec, dict(os.environ), available_cores(), attempt), agent, rdzv)
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        op = operation(args, cfg.run_dir, attempt, spec.gpus_per_node, lock)
        env.update(op.rank_env())
        if spec.nodes * spec.gpus_per_node > 1 and not args.doctor:
            print(road_line(live), flush=True)  # stdout: news, not a problem (stderr's one line is bad input's)
        print(f"launch: {shlex.join(argv_out)}", file=sys.stderr, flush=True)
        code = run(
            argv_out,
            env,
            rundir.status(cfg.run_dir),
            attempt,
            ranks=spec.gpus_per_node,
            op=op,
            agent=agent,
            run_dir=Path(cfg.run_dir),
        )
        if code == BAD_INPUT and config_mod.restore_resolved(settled):
            print(
                f"launch: {settled.path} is the run's previous config again (the reconfigure was refused)",
                file=sys.stderr,
            )
        return code


def settle_config(cfg: config_mod.RunConfig, reconfigure: bool, lock: runlock.RunLock | None) -> config_mod.Settled:
    """RUN_DIR/config.yaml under the run-dir lock (config.settle_resolved): written once, changed only by
    --reconfigure, which is refused while other launchers of an elastic job run on it and said in one line."""
    running = len(lock.live_members(lock.holder.job)) if lock is not None and lock.holder.job else 0
    settled = config_mod.settle_resolved(cfg, reconfigure=reconfigure, running=running)
    if settled.note:
        print(settled.note, file=sys.stderr, flush=True)
    return settled


def as_typed(spec: JobSpec, args: argparse.Namespace) -> JobSpec:
    """The built-in worker's job on the recipe and overrides as typed: what --dry-run prints, so the
    command runs as printed (the ranks of a launch read RUN_DIR/config.yaml, which a dry run never
    writes; run as printed, rank 0 resolves and writes it, as `python -m train` does)."""
    return spec.replace(config=args.config, overrides=tuple(args.overrides))


def elastic_job(spec: JobSpec, placement: NodePlacement, rdzv: str, live: bool = False) -> str | None:
    """The run-dir lock's job key of a launch whose nodes come and go (every node's launcher shares it):
    an elastic one, or a live one across nodes (node 0 may be lost while the others train on, so it
    cannot own the run dir alone, and `status` must see every node's launcher); None otherwise."""
    shared = spec.min_nodes is not None or (live and spec.nodes > 1)
    if not shared or placement.master_addr is None:
        return None
    return elastic.job_key(rdzv, placement.master_addr, spec.master_port)


def uses_agent(spec: JobSpec, placement: NodePlacement, doctor: bool) -> bool:
    return doctor or not runs_without_agent(spec, placement)


def doctor_config(private: Path, run_dir: str) -> str:
    """train.preflight reads a recipe; a user's program has none, so it gets the defaults, the
    synthetic data set (nothing to read) and the run dir to probe for shared storage."""
    path = private / "doctor.yaml"
    path.write_text(f"run_dir: {json.dumps(os.path.abspath(run_dir))}\ndata:\n  name: synthetic\n")
    return str(path)


def launch_program(args: argparse.Namespace, planned: Plan) -> int:
    """The same launch for a user's program: one rank each through the runner. Its job record, heartbeats
    and rank logs go to --run-dir when given (then `python -m launch status/logs/cancel RUN_DIR` work),
    else to the private folder of this launch."""
    attempt = uuid.uuid4().hex[:12]
    private = Path(tempfile.gettempdir()) / f"torchlaunch-{attempt}"  # status records (+ doctor recipe)
    spec, placement, program = planned.spec, planned.placement, planned.program
    assert program is not None
    module = BUILTIN_WORKER
    if args.doctor:
        module = PREFLIGHT
        spec = spec.replace(config=str(private / "doctor.yaml"))
    rdzv = rendezvous_id(spec, placement)
    argv_out = render(spec, placement, module, args.doctor)
    if args.dry_run:
        print(shlex.join(argv_out))
        return OK
    with owned(args.run_dir, placement, elastic_job(spec, placement, rdzv)) as lock:
        private.mkdir(mode=0o700)
        try:
            if args.doctor:
                doctor_config(private, args.run_dir or str(private / "doctor-run"))
            agent = uses_agent(spec, placement, args.doctor)
            env = launch_env(spec, dict(os.environ), available_cores(), attempt, status_folder=private)
            env = contract_env(env, agent, rdzv)
            if args.device == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            op = operation(args, args.run_dir or private / "run", attempt, spec.gpus_per_node, lock)
            env.update(op.rank_env())
            print(f"launch: {shlex.join(argv_out)}", file=sys.stderr, flush=True)
            return run(
                argv_out,
                env,
                private,
                attempt,
                label="training" if args.doctor else program.name,
                ranks=spec.gpus_per_node,
                op=op,
                agent=agent,
            )
        finally:
            shutil.rmtree(private, ignore_errors=True)


def new_checkpoint(run_dir: Path | None, since: float) -> tuple[int | None, bool]:
    """(newest valid checkpoint's step, whether it was committed since `since`) of a built-in run dir;
    read only after an exit 75 (it imports torch to verify the checkpoint)."""
    if run_dir is None:
        return None, False
    from torchlaunch.jobs import gather

    found, _ = gather.newest_checkpoint(run_dir)
    if found is None:
        return None, False
    return found.step, found.committed is not None and found.committed >= since


SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""How long torchrun's agent waits for its ranks after passing on a stop before it SIGKILLs them: set
from the platform's grace (torchlaunch.grace: the pod's, docker's 10 s in a container, torch's 30 s
where no platform is seen), not torch's fixed 30 s, which docker's 10 s cut short; `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` in the launcher's
environment wins. The ranks drop the step in flight on a stop (core/step_drop.py), so what must fit
in it is one checkpoint."""


def stop_env(environ: Mapping[str, str], container: bool | None = None) -> dict[str, str]:
    """The ranks' grace (TORCHLAUNCH_GRACE_S, for their save-time check) and torchrun's window from it."""
    seconds, _ = grace.platform_grace(environ, container)
    return {grace.GRACE_ENV: f"{seconds:g}", SHUTDOWN_TIMEOUT_ENV: str(grace.ranks_window_s(seconds))}


class StopRelay:
    """The launcher's handler for every stop signal, wherever it came from (a kubelet or `docker stop`
    to this PID, Ctrl-C to the terminal's process group, a scheduler to every process).

    The child (torchrun's agent, or the single worker) runs in a process group of its own, so a
    terminal's signals reach this process alone and the ranks hear of a stop exactly once: the first
    stop signal is passed on as one SIGTERM, which torchrun forwards to each rank's process group (the
    ranks checkpoint at one agreed step; their loader workers are shielded, torchlaunch.stop_signals).
    Later signals are the same stop and are not passed on again (a second SIGTERM would make torchrun
    abandon its graceful shutdown and kill the ranks mid-checkpoint), except a second SIGINT: a person
    pressing Ctrl-C again wants out now, so the whole tree is killed at once (exit 3, cancelled)."""

    def __init__(self, received: list[int], children: list[subprocess.Popen]) -> None:
        self.received = received
        self.children = children
        self.interrupted = False
        self._passed_on = False

    def receive(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if signum == signal.SIGINT and self.received.count(signal.SIGINT) >= 2:
            self.interrupted = True
            for child in self.children:
                pdeath.kill_tree(child.pid)
            return
        self.pass_on()

    def pass_on(self) -> None:
        if self._passed_on:
            return
        for child in self.children:
            self._passed_on = True
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        first = self.received[0] if self.received else signal.SIGTERM
        if self._passed_on and first != signal.SIGTERM:  # the ranks will say SIGTERM: say what came (issue 51)
            again = "; Ctrl-C again stops at once, without a checkpoint" if first == signal.SIGINT else ""
            line = f"launch: {signal.Signals(first).name}: passed on to the ranks as SIGTERM, the stop every program"
            os.write(2, f"{line} handles (they checkpoint at one agreed step){again}\n".encode())  # handler-safe


def own_group_dying_with(die_with_parent: Callable[[], None] | None) -> Callable[[], None]:
    """A Popen preexec_fn: the child leads a process group of its own (see StopRelay), and still dies
    with this launcher (pdeath.die_with_parent), since a group kill of the launcher no longer reaches it."""

    def preexec() -> None:
        os.setpgid(0, 0)
        if die_with_parent is not None:
            die_with_parent()

    return preexec


AGENT_GRACE_S = 30.0
"""After the watchdog ended the hung ranks: how long torchrun's agent gets to exit or start a new group.
Exiting takes it < 1 s where node 0's rendezvous store answers and at most its rendezvous close timeout
(30 s) where that times out; an agent cut off from the store blocks in a store read that nothing bounds
(faults suite, link cut for good: node 1's agent was still there 300 s after the cut, its worker killed)."""


def end_stuck_agent(
    child: subprocess.Popen, killed: Sequence[int], grace_s: float = AGENT_GRACE_S, err: IO[str] | None = None
) -> bool:
    """Called by the watchdog's thread after it killed the ranks `killed`: if torchrun's agent `child`
    neither exited nor started new workers (a restart) within `grace_s`, kill it and what it started
    (it would never exit on its own: its workers are dead and the job cannot progress) and say so in one
    line; the launcher then ends 1 (hung, retryable). True when it was ended. The tree is killed by pid,
    not by process group: the agent shares this launcher's group, its workers have sessions of their own."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if child.poll() is not None or restarted_workers(child.pid, killed):
            return False
        time.sleep(0.1)  # polling the agent under a deadline: there is no event for "stuck"
    if child.poll() is not None or restarted_workers(child.pid, killed):
        return False
    print(
        f"launch: torchrun's agent (pid {child.pid}) neither exited nor restarted the ranks {grace_s:.0f} s after "
        "the watchdog ended them (blocked on the rendezvous store on node 0?); ended it (exit 1, retryable)",
        file=err or sys.stderr,
        flush=True,
    )
    pdeath.kill_tree(child.pid)
    return True


def restarted_workers(agent_pid: int, killed: Sequence[int]) -> list[int]:
    """The agent's live children other than the ranks the watchdog killed: the workers of a restart."""
    return [
        pid
        for pid in pdeath.descendants(agent_pid)
        if pdeath.parent_of(pid) == agent_pid and pid not in killed and ops_procs.state(pid) not in (None, "Z", "X")
    ]


def run(
    argv: list[str],
    env: dict[str, str],
    status_folder: Path,
    attempt: str,
    label: str = "training",
    ranks: int | None = None,
    *,
    op: Operation | None = None,
    agent: bool = True,
    run_dir: Path | None = None,
) -> int:
    """Run torchrun (or the single worker), forward stop signals to it, and turn the workers' reports
    into one exit code. The child dies with this process, even by SIGKILL; torchrun's workers, in
    sessions of their own, die with torchrun (pdeath.die_with_agent in each rank)."""
    env = {**env, status.STATUS_DIR_ENV: str(status_folder)}
    what = "torchrun" if agent else "worker"
    started = time.time()
    read_fd, write_fd = os.pipe()
    if sys.stderr.isatty():
        env = {**env, contract.PROGRESS_BAR: "1"}  # workers see a pipe, the user a terminal
    forwarded: list[int] = []
    children: list[subprocess.Popen] = []
    stop = StopRelay(forwarded, children)
    previous = {sig: signal.signal(sig, stop.receive) for sig in FORWARDED_SIGNALS}
    # Only now, with the relay in place, are earlier stops read: one that lands while the handlers are
    # swapped is in one list or the other, never in neither (a scheduler's stop just after the
    # launcher's first line was lost that way, and the run trained to the end).
    forwarded[:0] = _EARLY_SIGNALS
    if forwarded:  # stopped before anything started: nothing to save, nothing lost
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(read_fd)
        os.close(write_fd)
        name = signal.Signals(forwarded[0]).name
        print(
            f"launch: {name} before the {what} started: nothing to save (exit 75); run the same command again",
            file=sys.stderr,
        )
        return PREEMPTED
    env = {**stop_env(os.environ), **env}
    child = subprocess.Popen(argv, env=env, stderr=write_fd, preexec_fn=own_group_dying_with(pdeath.die_with_parent()))
    children.append(child)
    if forwarded:  # a signal between the check above and Popen: pass it on now
        stop.pass_on()
    os.close(write_fd)
    relay = StderrRelay(read_fd, sys.stderr)
    try:
        if op is not None:

            def on_hang(verdict: watchdog.Verdict, folder: Path, beats: list[RankBeat]) -> None:
                killed = watchdog.kill_ranks(beats)  # torchrun restarts them while it may
                if agent:  # a single worker is the child itself: killing it ended it
                    end_stuck_agent(child, killed, AGENT_GRACE_S)

            op.start(on_hang)
        child_code = child.wait()
    except BaseException:
        pdeath.kill_tree(child.pid)  # leaving early: nothing of this run may train on
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.finish()
    if stop.interrupted:
        reason = f"second Ctrl-C: {what} and its ranks ended at once, without a checkpoint"
        # A person stopped the run for good: cancelled (3), never the retryable 1 or the requeued 75.
        code = op.finish(exit_codes.CANCELLED, reason) if op is not None else exit_codes.CANCELLED
        print(
            f"launch: {reason} (exit {code}); the same command resumes from the newest committed one", file=sys.stderr
        )
        return code
    found = status.records(status_folder, attempt)
    codes = [r.code for r in found]
    code = combine_exit_codes(child_code, codes, ranks, signalled=bool(forwarded), records=found)
    reason = next((r.reason for r in found if r.code == code and code != OK), "")
    lost = (0, None)
    said = max((r.committed for r in found if r.committed is not None), default=None)
    if op is not None and run_dir is not None:
        lost = lost_by_stop(code, bool(forwarded), run_dir, op.launch_id, said)
        if lost[0]:  # 75 says "nothing lost, run it again"; this stop lost steps: a failure, honestly
            code = FAILURE
            reason = lost_line(lost, forwarded)
    if op is not None:
        code = op.finish(code, reason)
    if code == OK and child_code != 0:
        print(
            f"launch: every rank reported a finish; exit {child_code} came from a rank's teardown after it (ignored)",
            file=sys.stderr,
        )
    if code == BAD_INPUT:
        reason = next((r.reason for r in found if r.code == BAD_INPUT), "bad input")
        print(f"launch: workers stopped on bad input (exit 2, not retried): {reason}", file=sys.stderr)
    elif code == PREEMPTED:  # a rank's word that it committed, else what verifies (the marker's mtime)
        step, new = (said, True) if said is not None else new_checkpoint(run_dir, started - 1.0)
        print(f"launch: {preempted_line(found, forwarded, step, new, run_dir)}", file=sys.stderr)
    elif code == exit_codes.CANCELLED:
        step, _ = new_checkpoint(run_dir, started - 1.0)
        at = f" (newest checkpoint: step {step})" if step is not None else ""
        print(f"launch: cancelled (exit {code}, never requeued){at}; the same command resumes", file=sys.stderr)
    elif code == FAILURE and lost[0]:
        print(f"launch: {lost_line(lost, forwarded)}", file=sys.stderr)
    elif code == FAILURE:
        first = status.first_failure(found)
        if first is None or ranks is None or len(found) < ranks:
            relay.release_held()  # a rank left no word (killed, crashed hard): torchrun's report names it
        cause = f": rank {first.rank}: {first.reason.split(' failed: ', 1)[-1]}" if first and first.reason else ""
        print(
            f"launch: {label} failed{cause} ({what} exit {child_code}, worker codes {sorted(set(codes)) or 'none'})",
            file=sys.stderr,
        )
    return code


def preempted_line(
    found: Sequence[status.Record],
    forwarded: Sequence[int],
    step: int | None,
    new: bool,
    run_dir: Path | None,
) -> str:
    """What an exit 75 means, saying only what is known: a committed checkpoint is claimed only where
    this launcher sees one committed during this launch (the built-in worker's run dir) or the program
    said it committed one (status.note_committed: torchlaunch.api)."""
    by = f" after {signal.Signals(forwarded[0]).name}" if forwarded else ""
    said = [r.committed for r in found if r.committed is not None]
    if run_dir is None and said:
        step, new = max(said), True
    if new:
        return (
            f"preempted with a committed checkpoint (exit 75) at step {step}{by}; run the same command again to resume"
        )
    if run_dir is not None:
        since = f"step {step}" if step is not None else "the beginning"
        return f"exit 75{by} without a new checkpoint in {run_dir}; the same command again restarts from {since}"
    stopped = next((r.reason for r in found if program_mod.stopped_by_runner(r.reason)), None)
    if stopped is not None:  # the runner's own handler stopped a program that had none (runner.SignalOwner)
        return f"preempted{by}: {stopped}"
    if any("without declaring" in r.reason for r in found):
        return (
            f"preempted{by}: the program ended without declaring the run finished (exit 75); run the same "
            "command again to resume from the program's own checkpoint"
        )
    return f"preempted{by}: the program exited 75; run the same command again to resume from its own checkpoint"


if __name__ == "__main__":
    sys.exit(main())
