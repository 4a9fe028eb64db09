"""The node agent in live mode (recovery.live): the membership service and one node's ranks.

    python -m torchlaunch.agent.live --nproc 2 --heartbeat-timeout-ms 1000 -- -m torchlaunch.runner ...
    python -m torchlaunch.agent.live --nproc 2 --nnodes 3 --node-rank 1 --master-addr node0 \
        --master-port 29500 --lighthouse http://lighthouse:29510 -- -m torchlaunch.runner ...
    python -m torchlaunch.agent.live --nproc 2 --nnodes 1:3 --node-rank 2 --first-seat 1 \
        --first-nodes 2 --master-addr node0 ...   # MIN:MAX: the launcher's first group (first_group.py)

Why not torchrun's agent: it ends every rank of the group when one fails and starts them all again,
which is exactly the restart live mode avoids. This agent starts the ranks with torchrun's env contract
(each in a session of its own, dying with this agent: pdeath.die_with_agent), starts the membership
service (live/lighthouse.py) in a process of its own, restarts it on the same address if it
dies (its state is soft: the ranks' next heartbeats fill it again), and waits for the ranks; the
service hears of a rank lost from the rank's own presence connection (live/presence.py),
here as across nodes. A job across
nodes runs one agent per node and the service apart from all of them (`--lighthouse`, started with
`python -m launch.lighthouse` on a host of its own): a service inside one node's agent would die with
that node and take the group's membership along. It also
watches each rank's pulse (live/pulse.py): a rank silent past the heartbeat bound (frozen by
SIGSTOP, say) is SIGKILLed with its process group, so that its peers' collective fails with a transport
error and they regroup without it, instead of waiting for `dist.timeout_s`.

Its exit code: a rank that was lost (ended by a signal, e.g. SIGKILL) while the others finished is
what live mode is for, so the job's outcome is the survivors': 0 when they all finished 0. A rank that
exited non-zero by itself (bad input, a failure, a preemption) gives the job its code, as torchrun's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torchlaunch import contract, roads
from torchlaunch.agent import live_shared
from torchlaunch.agent.live_rejoin import (
    Joiners,
    abandon_failed_joiners,
    end_orphan_joiners,
    end_past_the_stop_window,
    rejoin,
    stop_after_a_failure,
    stop_window_s,
)
from torchlaunch.agent.live_shared import LOOPBACK, job_code
from torchlaunch.agent.placed import Placed, free_port, free_port_pair
from torchlaunch.base import procs
from torchlaunch.exit_codes import OK, BadInput
from torchlaunch.launch import elastic, shape

LIVE = roads.get("live")
"""The road this agent runs (torchlaunch/live/ through the road registry): its pulse, minimum and service."""
POLL_S = 0.05
SERVICE_START_S = 30.0
"""How long the membership service may take to listen (its process imports torchft's bindings)."""


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m torchlaunch.agent.live --nproc N [...] -- PROGRAM...")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m torchlaunch.agent.live")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    parser.add_argument("--run-id", default="torchlaunch-live")
    parser.add_argument("--rejoin", type=int, default=0, help="times a lost rank is started again (recovery.rejoin)")
    shape.add(parser, "nnodes", default="1")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default=LOOPBACK, help="node 0's address: the first group's store")
    shape.add(parser, "master_port", help="node 0's port for the first group's store (default: a free one)")
    parser.add_argument("--lighthouse", default="", help="the membership service apart (http://HOST:PORT)")
    parser.add_argument(
        "--run-dir",
        default="",
        help="across nodes without --lighthouse: the run dir whose lease places the service on one of the "
        "job's nodes (live/placement.py)",
    )
    parser.add_argument(
        "--join-attempt",
        type=int,
        default=0,
        help="this node replaces a lost one of a job that trains: its ranks join with this attempt number",
    )
    parser.add_argument(
        "--first-seat",
        type=int,
        default=None,
        help="--nnodes MIN:MAX: this node's place among the first group's nodes (default: its node rank)",
    )
    parser.add_argument(
        "--first-nodes",
        type=int,
        default=None,
        help="--nnodes MIN:MAX: how many nodes form the first group (default: MAX)",
    )
    args = parser.parse_args(argv[:cut])
    try:
        shape.check(args)
    except BadInput as e:
        parser.error(str(e))
    if not 0 <= args.join_attempt < 10**9:
        parser.error("--join-attempt takes 0 (a first launch) or a positive attempt number")
    args.nnodes = args.node_range.max
    args.min_nodes = args.node_range.min if args.node_range.elastic else None
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} outside 0..{args.nnodes - 1}")
    why = first_group_problem(args)
    if why:
        parser.error(why)
    if args.nnodes > 1 and not ((args.lighthouse or args.run_dir) and args.master_port):
        parser.error("--nnodes above 1 needs --master-port, and --run-dir (the service placed) or --lighthouse")
    return args, argv[cut + 1 :]


def first_group_problem(args: argparse.Namespace) -> str:
    """Why --first-seat/--first-nodes do not fit (pure; '' when they do), after filling their defaults:
    the first group of a range holds MIN..MAX nodes, this one among them; a fixed count has no choice."""
    if args.min_nodes is None:
        if args.first_seat is not None or args.first_nodes is not None:
            return "--first-seat and --first-nodes come with --nnodes MIN:MAX (a fixed count starts every node)"
        return ""
    args.first_nodes = args.nnodes if args.first_nodes is None else args.first_nodes
    args.first_seat = args.node_rank if args.first_seat is None else args.first_seat
    if not args.min_nodes <= args.first_nodes <= args.nnodes:
        return f"--first-nodes {args.first_nodes} outside --nnodes {args.min_nodes}:{args.nnodes}"
    if not 0 <= args.first_seat < args.first_nodes:
        return f"--first-seat {args.first_seat} outside 0..{args.first_nodes - 1}"
    return ""


@dataclass(frozen=True)
class NodeSeat:
    """Where this agent's node sits in the job: torchrun's contract is computed from it."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: int = 0
    min_nodes: int | None = None
    """--nnodes MIN:MAX: MIN, passed to the ranks (live/minimum.py owns what it means)."""
    first_seat: int | None = None
    """--nnodes MIN:MAX: this node's place among the first group's nodes (first_group.py)."""
    first_nodes: int | None = None
    """--nnodes MIN:MAX: how many nodes form the first group."""


def store_host(seat: NodeSeat, lighthouse: str) -> str:
    """The address this node's ranks give their stores (agent/live_shared.py)."""
    return live_shared.store_host(seat.nnodes, seat.master_addr, lighthouse)


def rank_env(
    base: dict[str, str],
    local_rank: int,
    seat: NodeSeat,
    lighthouse: str,
    run_id: str,
    pulse_fd: int,
    host: str = LOOPBACK,
) -> dict[str, str]:
    """torchrun's contract for local rank `local_rank` of this node (pure; global rank = node rank x
    nproc + local rank), plus the service's address, the address its store is reached on and the
    rank's pulse pipe; with a node range, MIN and the rank's place in the first group (range_env)."""
    rank, world = seat.node_rank * seat.nproc + local_rank, seat.nnodes * seat.nproc
    return {
        **range_env(local_rank, seat),
        **base,
        contract.RANK: str(rank),
        contract.LOCAL_RANK: str(local_rank),
        contract.WORLD_SIZE: str(world),
        contract.LOCAL_WORLD_SIZE: str(seat.nproc),
        contract.GROUP_RANK: str(seat.node_rank),
        contract.GROUP_WORLD_SIZE: str(seat.nnodes),
        contract.ROLE_RANK: str(rank),
        contract.ROLE_NAME: "default",
        contract.ROLE_WORLD_SIZE: str(world),
        contract.MASTER_ADDR: seat.master_addr,
        contract.MASTER_PORT: str(seat.master_port),
        contract.LIVE_STORE_HOST: host,
        contract.ELASTIC_RUN_ID: run_id,
        contract.RESTART_COUNT: "0",
        contract.MAX_RESTARTS: "0",
        contract.USE_AGENT_STORE: "False",
        contract.LIGHTHOUSE: lighthouse,
        contract.LIVE_PULSE_FD: str(pulse_fd),
    }


def range_env(local_rank: int, seat: NodeSeat) -> dict[str, str]:
    """What a rank of a --nnodes MIN:MAX launch adds to torchrun's contract (pure). RANK stays the rank
    this node's --node-rank gives it (its replica id and its files follow it, and a late node's ranks
    never take a first-group rank's), and WORLD_SIZE MAX nodes' worth; the first group, formed by the
    nodes that came in time, is `seat x nproc + local rank` of `nodes x nproc`
    (contract.LIVE_FIRST_GROUP), always formed, even of one rank, so that later nodes can join it. MIN
    goes to the ranks as Slurm's task passes it (minimum.passed)."""
    if seat.min_nodes is None:
        return {}
    first_seat = seat.node_rank if seat.first_seat is None else seat.first_seat
    first_nodes = seat.nnodes if seat.first_nodes is None else seat.first_nodes
    first = f"{first_seat * seat.nproc + local_rank}/{first_nodes * seat.nproc}"
    said = f"--nnodes {seat.min_nodes}:{seat.nnodes}"
    return {contract.LIVE_FIRST_GROUP: first, **LIVE.minimum.passed(seat.min_nodes, said)}


class Service:
    """The membership service's process, restartable on the same address (its state is soft). It hears
    of a rank's loss from the rank itself (its presence connection ends with its process), so this
    agent tells it nothing; what the agent keeps is the count of ranks in the group, for a restarted
    service to wait for them all rather than form a group of the first to ask back."""

    def __init__(self, port: int, heartbeat_timeout_ms: int) -> None:
        self.port, self.heartbeat_timeout_ms = port, heartbeat_timeout_ms
        self.address = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.members = 1
        """The ranks last known alive and in the group: a restarted service waits for them all."""

    def start(self) -> None:
        argv = [
            sys.executable,
            "-m",
            LIVE.service,
            "--bind",
            f"127.0.0.1:{self.port}",
            "--heartbeat-timeout-ms",
            str(self.heartbeat_timeout_ms),
            "--await-ranks",
            str(self.members),
            "--with-agent",  # it ends when this agent's end of its stdin closes, however the agent died
        ]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + SERVICE_START_S
        while not elastic.listening("127.0.0.1", self.port, timeout_s=0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"live: the membership service did not start on port {self.port}")
            time.sleep(POLL_S)

    def keep_up(self, ranks: list[subprocess.Popen], in_group: Callable[[int], bool]) -> None:
        """Restart the service if it died, waiting for the ranks alive and in the group (not a joiner
        still on its way in: a regroup must not wait for one)."""
        self.members = max(1, sum(1 for r, p in enumerate(ranks) if p.poll() is None and in_group(r)))
        if self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            print(f"live: the membership service exited ({self.proc.returncode}); restarted", file=sys.stderr)
            self.start()

    def stop(self) -> None:
        procs.end(self.proc)


def start_rank(program: list[str], env: dict[str, str], pulse_fd: int) -> subprocess.Popen:
    """A rank in a session of its own (its loader workers share its process group), holding the write
    end of its pulse pipe."""
    try:
        return subprocess.Popen([sys.executable, *program], env=env, start_new_session=True, pass_fds=(pulse_fd,))
    finally:
        os.close(pulse_fd)  # the rank's own now: its end of file tells this agent it is gone


def fence_silent(ranks: list[subprocess.Popen], watch: Any, fenced: dict[int, str]) -> None:
    """SIGKILL each rank silent past the bound, with its process group (its loader workers): its
    sockets close, so its peers' collective fails at once and they regroup (live/pulse.py)."""
    for rank, seconds in watch.silent().items():
        watch.forget(rank)
        proc = ranks[rank]
        if proc.poll() is not None:
            continue
        why = procs.unresponsive(proc.pid) or "not beating"
        fenced[rank] = f"silent {seconds:.1f} s, {why}"
        print(
            f"live: rank {rank} silent for {seconds:.1f} s ({why}), past the {watch.bound_s:g} s bound: "
            "killed so that the others go on without it",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    args, program = parse_args(sys.argv[1:] if argv is None else argv)
    across = args.nnodes > 1  # the service apart (--lighthouse) or placed by the run dir's lease (Placed)
    service = None if args.lighthouse or across else Service(free_port_pair(), args.heartbeat_timeout_ms)
    if service is not None:  # the service and the ranks inherit it; a stranger's presence hello cannot prove it
        os.environ[contract.LIVE_PRESENCE_KEY] = secrets.token_hex(32)
    lighthouse = args.lighthouse or (service.address if service is not None else "")
    seat = NodeSeat(
        args.nproc,
        args.nnodes,
        args.node_rank,
        args.master_addr,
        args.master_port or free_port(),
        args.min_nodes,
        args.first_seat,
        args.first_nodes,
    )
    host = store_host(seat, lighthouse)
    placed = (
        Placed.start(args.run_dir, args.heartbeat_timeout_ms, seat.node_rank, seat.nnodes, seat.nproc, host)
        if across and not args.lighthouse
        else None
    )
    if placed is not None:
        try:
            lighthouse = placed.wait_for_service()
        except BaseException:
            placed.close()
            raise
    ranks: list[subprocess.Popen] = []
    watch = LIVE.pulse.Watch(args.heartbeat_timeout_ms / 1000)
    fenced: dict[int, str] = {}
    restarts = [0] * args.nproc
    joiner = Joiners(args.join_attempt, restarts)
    replaced: list[str] = []  # "rank R (SIGNAL...)" of each process lost and started again
    stopping: float | None = None  # when a stop was passed on to the ranks
    window_s = stop_window_s()
    failed_at: float | None = None
    abandoned: set[int] = set()  # ranks started again that failed before they joined

    def stop(signum: int, frame: object) -> None:  # a stop is the ranks' to handle (checkpoint, exit 75)
        nonlocal stopping
        if stopping is None:
            stopping = time.monotonic()
        for proc in ranks:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    def start(rank: int) -> subprocess.Popen:
        read_fd, write_fd = os.pipe()
        watch.add(rank, read_fd)
        env = rank_env(dict(os.environ), rank, seat, lighthouse, args.run_id, write_fd, host)
        if placed is not None:  # the service may move to another node: the rank follows the run dir's lease
            env[contract.LIVE_PLACED] = "1"
        if joiner(rank):  # it forms no first group: it joins the live one
            env[contract.LIVE_JOIN] = str(joiner.attempt(rank))
            env.pop(contract.LIVE_FIRST_GROUP, None)
        proc = start_rank(program, env, write_fd)
        watch.follow(rank, proc.pid)  # a rank whose main thread runs is slow, not silent (pulse.py)
        return proc

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    if service is not None:
        service.start()
    try:
        ranks.extend(start(rank) for rank in range(args.nproc))
        while any(proc.poll() is None for proc in ranks):
            if service is not None:
                service.keep_up(ranks, lambda r: not joiner(r) or r in watch.joined)
            if placed is not None:
                placed.tick()
            fence_silent(ranks, watch, fenced)
            if stopping is None:
                rejoin(ranks, restarts, args.rejoin, fenced, replaced, start)
            end_past_the_stop_window(ranks, stopping, window_s)
            end_orphan_joiners(ranks, joiner, watch.joined)
            abandon_failed_joiners(ranks, joiner, watch.joined, abandoned)
            failed_at = stop_after_a_failure(ranks, failed_at, abandoned)
            time.sleep(POLL_S)
    finally:
        watch.close()
        for proc in ranks:  # leaving early (an error here): no rank trains on without its agent
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if service is not None:
            service.stop()
        if placed is not None:
            placed.close()
    codes = [proc.returncode for proc in ranks]
    lost = [rank for rank, code in enumerate(codes) if code < 0]
    kept = [c for r, c in enumerate(codes) if r not in abandoned]
    code = job_code(kept or codes)  # every rank given up on (a refused second launch): theirs is the outcome
    if lost or replaced or abandoned:
        names = ", ".join(
            replaced
            + [f"rank {r} ({signal.Signals(-codes[r]).name}{', ' + fenced[r] if r in fenced else ''})" for r in lost]
            + [f"rank {r} (started again, exit {codes[r]} before it joined)" for r in sorted(abandoned)]
        )
        outcome = "the others finished" if code == OK else f"exit {code}"
        print(f"live: lost {names}; {outcome}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
