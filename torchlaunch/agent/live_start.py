"""The node agent's side of live mode (recovery.live) before its ranks start: whether the launch is
live, whether this node replaces a lost one, and, for --nnodes MIN:MAX, its number and its seat in the
first group (first_group.py).

Why here and not in the live agent (live.py): these decisions read the run-dir lock this launcher holds
(runlock) and its plan, and are made once per launch; the live agent only runs what they decided.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import signal
import sys
import time
from typing import Any

from torchlaunch import config as config_mod
from torchlaunch import roads, rundir, runlock
from torchlaunch.agent import first_group, stops
from torchlaunch.agent.commands import NodePlacement
from torchlaunch.agent.options import check_rendezvous
from torchlaunch.agent.outcome import LaunchEnded
from torchlaunch.exit_codes import FAILURE, PREEMPTED
from torchlaunch.launch import cli, shape
from torchlaunch.launch.spec import JobSpec


def live_mode(cfg: config_mod.RunConfig, spec: JobSpec, placement: NodePlacement, doctor: bool) -> bool:
    """Whether this launch runs its ranks under the live agent: recovery.live auto (the default) or true,
    several ranks in all, not --doctor (one rank or a pre-flight has nobody to regroup with, even with an
    explicit true: the restart road as ever). Across nodes (--nnodes N, or MIN:MAX: first_group.py) the
    agents place the membership service on one of the job's nodes through the run dir
    (live/placement.py), unless recovery.lighthouse names one of the user's own."""
    road = roads.choose(cfg.recovery.live, possible=not doctor and spec.nodes * spec.gpus_per_node > 1)
    return bool(road.regroups)


def require_live_extra() -> None:
    """Live mode's membership service is torchft's: one line before anything starts when it is missing."""
    if importlib.util.find_spec("torchft") is None:
        raise cli.error(
            "recovery.live=true needs torchft (the membership service): pip install 'torchlaunch[live]' "
            "(make install-live), or set recovery.live=false"
        )


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
    lost node once a group formed since (live/fence.py). The attempt is past every generation,
    so its ranks' ids differ from the lost node's. Only a launch across nodes shares the lock by job."""
    if lock is None or lock.slot is None:
        return 0
    fence = roads.get("live").fence.Fence(run_dir)  # live mode across nodes only: no import otherwise
    if lock.founded or not founder_recorded(lock, fence):
        fence.found(lock.holder.incarnation)
        return 0
    return fence.current() + 1 if fence.formed_since_founded() else 0


FOUNDER_WAIT_S = 30.0
"""How long a joining launcher waits for its founder's record (written once the founder's config is
settled: milliseconds to seconds after it took the run dir)."""


def founder_recorded(lock: runlock.RunLock, fence: Any, wait_s: float = FOUNDER_WAIT_S) -> bool:
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


def joins_a_live_group(lock: runlock.RunLock | None, run_dir: str) -> bool:
    """Whether this launcher, holding its job's lock, will start its ranks as joiners of a group that
    trains already (replaces_a_lost_node's answer, read without waiting or writing: a founder that has
    not recorded its run yet formed no group, so a launcher that arrives then starts in the first one)."""
    if lock is None or lock.slot is None or lock.founded:
        return False
    fence = roads.get("live").fence.Fence(run_dir)  # live mode across nodes only
    return fence.founder() == lock.holder.incarnation and fence.formed_since_founded()


def check_first_group(args: argparse.Namespace, lock: runlock.RunLock | None, run_dir: str) -> None:
    """check_rendezvous for a launch that meets_at_node_0_first, once it holds the job's lock: a launcher
    that starts in the first group needs node 0's name to resolve (and node 0 its port), bad input
    otherwise (one line, exit 2, before its config is settled or anything recorded in RUN_DIR/live), or,
    with --master-wait-s (nodes started in any order), it waits for the name first (resolve_master_addr);
    one that replaces a lost node needs neither, and never waits."""
    if not joins_a_live_group(lock, run_dir):
        check_rendezvous(args)


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


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def meet_first_group(
    lock: runlock.RunLock | None, cfg: config_mod.RunConfig, spec: JobSpec, placement: NodePlacement
) -> tuple[int, first_group.FirstSeat | None]:
    """--nnodes MIN:MAX in live mode: wait in the run dir for the first group (first_group.py) and say
    where this node stands in it. The window after MIN nodes is the elastic rendezvous's last call
    (--rdzv-conf last_call_timeout, 10 s by default); the wait for MIN nodes its join_timeout (600 s)."""
    from torchlaunch.agent import live_shared

    assert lock is not None and lock.holder.job and placement.master_addr is not None  # check_nodes, elastic_job
    nodes = shape.NodeRange(spec.min_nodes or spec.nodes, spec.nodes)
    conf = dict(placement.rdzv_conf)
    host = live_shared.store_host(spec.nodes, placement.master_addr, cfg.recovery.lighthouse)
    me = first_group.Arrival(placement.node_rank, host, lock.holder.token, time.time())
    fence = roads.get("live").fence.Fence(cfg.run_dir)
    job = lock.holder.job

    def live_tokens() -> set[str]:
        return {m.token for m in lock.live_members(job)}

    meeting = first_group.Meeting(rundir.live(cfg.run_dir), me, live_tokens, fence.current)
    stopped = lambda: bool(stops.EARLY_SIGNALS)  # noqa: E731 - a stop while waiting: nothing trained here
    spelled = f"--nnodes {nodes.torchrun()}"
    try:
        met = meeting.meet(
            nodes, conf.get("last_call_timeout", 10), conf.get("join_timeout", first_group.JOIN_TIMEOUT_S), stopped
        )
    except TimeoutError as e:
        raise LaunchEnded(FAILURE, f"no first live group of {spelled}: {e}; nothing trained (exit 1)") from None
    if met is None:
        name = signal.Signals(stops.EARLY_SIGNALS[0]).name
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
