"""The node agent's command line (`python -m launch.local`, a Kubernetes pod's `python -m
torchlaunch.agent`) and every check made before anything starts: the plan.

Why before anything: bad input is one line and exit 2 while nothing is written, and a scheduler never
retries it; a wait that runs out (--master-wait-s) or a stop during it ends the launch with 1 or 75
(outcome.LaunchEnded) instead.
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from torchlaunch import config as config_mod
from torchlaunch import exit_codes, roads, rundir
from torchlaunch import runner as program_mod
from torchlaunch.agent import stops
from torchlaunch.agent.commands import MASTER_ADDR_REQUIRED, NodePlacement
from torchlaunch.agent.outcome import LaunchEnded
from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import FAILURE, PREEMPTED
from torchlaunch.launch import cli, elastic, precheck, shape
from torchlaunch.launch.spec import DEFAULT_MASTER_PORT, JobSpec


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
        run_dir_help="with a program after --: the shared folder of its job records, --doctor's checks and, with "
        "--nnodes MIN:MAX, its rendezvous (default: a private temporary folder)",
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
    if args.nnodes > 1 and args.master_addr is None and not args.meets_in_run_dir:
        raise cli.error(MASTER_ADDR_REQUIRED)  # live or not: a node on another host would wait alone


def check_nodes(args: argparse.Namespace) -> None:
    """--nnodes N or MIN:MAX (parsed by shape.check), and what only one of them takes; what depends on
    live mode (known once the recipe is read) is check_range's."""
    nodes = args.node_range
    args.rdzv = elastic.parse_rdzv_conf(args.rdzv_conf, elastic.DEFAULT_RDZV) if nodes.elastic else ()
    # commands.meets_in_run_dir: a program's node range meets in its --run-dir, no node 0 needed
    args.meets_in_run_dir = nodes.elastic and args.program is not None and args.run_dir is not None
    if nodes.elastic:
        if args.master_addr is None and not args.meets_in_run_dir:
            raise cli.error(
                f"--nnodes {nodes.torchrun()} needs --master-addr HOST (the host of the rendezvous store; "
                "127.0.0.1 for several launchers on this machine), or with a program after --, --run-dir DIR "
                "on storage every node shares (the nodes meet there)"
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
                f"--rdzv-conf {key}: the live road has no torchrun rendezvous after its first group (a lost node "
                f"is judged by recovery.heartbeat_timeout_s); its keys are {' and '.join(LIVE_RDZV_KEYS)}, "
                "or recovery.live=false for torchrun's elastic restart"
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
        if stops.EARLY_SIGNALS:
            name = signal.Signals(stops.EARLY_SIGNALS[0]).name
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
        roads.choose(cfg.recovery.live, possible=not args.doctor).regroups
        and args.nnodes > 1
        and not args.node_range.elastic
        and args.master_addr is not None
    )


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


def visible_gpus() -> int:
    known = precheck.visible_gpus_without_torch()  # no torch import on machines without GPUs
    if known is not None:
        return known
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
    check_range(args, live=roads.choose(cfg.recovery.live, possible=True).regroups)
    check_devices(args)
    precheck.check(cfg, on_cpu=args.device == "cpu" or visible_gpus() == 0, local=True, doctor=args.doctor)
    recipe = rundir.doctor_config(cfg.run_dir) if args.doctor else rundir.config(cfg.run_dir)
    spec = JobSpec(config=str(recipe), run_dir=cfg.run_dir, **common)
    return Plan(spec, placement, cfg, None)
