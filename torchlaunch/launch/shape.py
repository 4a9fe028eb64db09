"""The machine-shape options of every launcher (nodes, workers per node, CPUs, memory, restarts, the
rendezvous port): spelled, described and bounded here once, declared on a launcher's parser with
`add`, and checked with `check` before anything starts.

Each launcher keeps its scheduler's own words (torchrun's `--nnodes`/`--gpus` on this machine, sbatch's
`--nodes`/`--tasks-per-node` on Slurm, per-pod counts on Kubernetes): users arrive knowing those. What
is shared is the meaning behind a name, its bounds and its error line.

A number a real machine or scheduler cannot meet either fails late (inside the job, after the queue)
or never (a job pending forever, a rendezvous waiting forever, the OOM killer): each is refused here
in one line, exit 2. Torch-free; the network checks are bounded in time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Protocol

from torchlaunch.base import rules
from torchlaunch.base.untrusted import quote
from torchlaunch.launch import cli

MAX_NODES = 100_000
"""Machines per job: Kubernetes' limit on an Indexed Job's completions and parallelism."""
MAX_PER_NODE = 1024
"""Worker processes per machine."""
MAX_RESTARTS = 1000
CPU_WORKERS_PER_CORE = 4
"""CPU workers (no GPU) per usable core: each imports torch and holds a model copy; beyond a few per
core they only add memory (96 on a laptop is the OOM killer, not a faster job)."""
MIN_CPU_WORKERS = 8
RESOLVE_TIMEOUT_S = 10.0
"""Longest wait for the rendezvous host's name to resolve (a wrong one otherwise costs ~80 s and a
traceback in every rank)."""
HOST = rules.HOST


def within(flag: str, value: int | None, low: int, high: int, example: str) -> None:
    """`flag` in low..high (None: not given, nothing to check)."""
    if value is not None and value < low:
        raise cli.error(f"{flag} must be >= {low}, got {value} (e.g. {flag} {example})")
    if value is not None and value > high:
        raise cli.error(f"{flag} must be at most {high}, got {value} (e.g. {flag} {example})")


def port(flag: str, value: int | None) -> None:
    if value is not None and not 1 <= value <= 65535:
        raise cli.error(f"{flag} must be a port number in 1..65535, got {value} (e.g. {flag} 29500)")


@dataclass(frozen=True)
class NodeRange:
    """MIN..MAX nodes; a fixed count is MIN == MAX (not elastic)."""

    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min != self.max

    def torchrun(self) -> str:
        """torchrun's --nnodes value."""
        return f"{self.min}:{self.max}" if self.elastic else str(self.max)


RANGE = re.compile(r"^\s*(\d+)\s*(?:([:-])\s*(\d+)\s*)?$", re.ASCII)


def parse_nodes(flag: str, text: str | int, example: str = "2") -> NodeRange:
    """`N`, `MIN:MAX` (torchrun's spelling) or `MIN-MAX` (Slurm's) -> NodeRange, checked once here:
    MIN >= 1, MIN <= MAX, MAX within the launcher bound. One line naming the fix otherwise."""
    found = RANGE.match(str(text))
    if found is None:
        raise cli.error(f"{flag} {str(text)[:40]!r}: pass a node count N or a range MIN:MAX (e.g. {flag} {example})")
    low = int(found.group(1))
    high = int(found.group(3)) if found.group(3) is not None else low
    within(flag, low, 1, MAX_NODES, example)
    within(flag, high, 1, MAX_NODES, example)
    if low > high:
        sep = found.group(2)  # the user's spelling: torchrun's MIN:MAX or Slurm's MIN-MAX
        raise cli.error(
            f"{flag} {str(text).strip()[:40]!r}: MIN {low} is more than MAX {high} (e.g. {flag} {high}{sep}{low})"
        )
    return NodeRange(low, high)


class Declares(Protocol):
    """A parser or an argument group of one."""

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action: ...


@dataclass(frozen=True)
class Option:
    """One machine-shape option: its flag, the range a real machine or scheduler can meet, an example
    for the error line and the help users read (a launcher may say it in its own words)."""

    flag: str
    low: int
    high: int
    example: str
    help: str
    nodes: bool = False
    """A node count or range (N, MIN:MAX or MIN-MAX), parsed to args.node_range."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


OPTIONS: dict[str, Option] = {
    o.dest: o
    for o in (
        Option("--nnodes", 1, MAX_NODES, "2", "number of nodes in the job, or MIN:MAX", nodes=True),
        Option("--nodes", 1, MAX_NODES, "2", "nodes in the job, or a range MIN:MAX", nodes=True),
        Option("--gpus", 1, MAX_PER_NODE, "8", "worker processes on this node (one per GPU)"),
        Option("--gpus-per-node", 1, MAX_PER_NODE, "8", "worker processes per node, one per GPU"),
        Option("--tasks-per-node", 1, MAX_PER_NODE, "4", "CPU worker processes per node (no GPUs)"),
        Option("--cpus-per-task", 1, 4096, "8", "CPU cores per worker process"),
        Option("--cpus-per-gpu", 1, 1024, "8", "CPU cores per GPU"),
        Option("--mem-gb", 1, 1 << 16, "64", "memory per node, GB"),
        Option("--mem-gb-per-gpu", 1, 1 << 14, "32", "memory per GPU, GB"),
        Option("--time", 1, 366 * 24 * 60, "240", "minutes per allocation"),
        Option("--signal-delay-s", 0, 3600, "90", "seconds between the preemption signal and the time limit"),
        Option("--max-restarts", 0, MAX_RESTARTS, "3", "torchrun restarts of the worker group"),
        Option("--max-timeouts", 0, MAX_RESTARTS, "3", "requeues after a time limit or preemption"),
        Option("--master-port", 1, 65535, "29500", "rendezvous port on node 0"),
        Option("--master-wait-s", 0, 7 * 24 * 3600, "600", "seconds to wait for --master-addr to resolve"),
    )
}
"""Every machine-shape option of every launcher, by argparse dest."""


def add(parser: Declares, dest: str, *, default: object = None, help: str | None = None) -> None:
    """Declare OPTIONS[dest] on a launcher's parser (or one of its groups), in the launcher's words
    when `help` is given."""
    option = OPTIONS[dest]
    parser.add_argument(
        option.flag,
        type=None if option.nodes else int,
        default=default,
        help=help or option.help,
    )


def check(args: argparse.Namespace, node_example: str = "2") -> None:
    """Every shape option the launcher declared, within its bounds (one line, exit 2, otherwise); a node
    count or range is parsed to args.node_range."""
    for dest, option in OPTIONS.items():
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if option.nodes:
            args.node_range = parse_nodes(option.flag, value, node_example)
        elif dest == "master_port":
            port(option.flag, value)
        else:
            within(option.flag, value, option.low, option.high, option.example)


def cpu_worker_cap() -> int:
    """The most CPU worker processes this machine can run side by side."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(MIN_CPU_WORKERS, CPU_WORKERS_PER_CORE * cores)


def master_addr(flag: str, addr: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """A host name or address that resolves within timeout_s, else one line."""
    if not HOST.fullmatch(addr):
        raise cli.error(f"{flag} {quote(addr, 80)} is not a host name or address (e.g. {flag} node0 or 10.0.0.1)")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(socket.getaddrinfo, addr.strip("[]"), None)
    try:
        future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise cli.error(
            f"{flag} {quote(addr, 80)} did not resolve within {timeout_s:.0f} s (check the name and DNS)"
        ) from None
    except OSError as e:
        raise cli.error(
            f"{flag} {quote(addr, 80)} does not resolve: {e.strerror or e} (pass node 0's host name or address)"
        ) from None
    finally:
        pool.shutdown(wait=False)


def bindable(flag: str, value: int) -> None:
    """Node 0 hosts the rendezvous: a port already in use would leave every node waiting forever.
    SO_REUSEADDR as torch's TCPStore sets it: a port whose only users are connections of a killed run
    (TIME_WAIT, for a minute after a SIGKILLed node) is free for the store, and so for this check; a
    socket listening on it is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", value))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise cli.error(f"{flag} {value} {why} on this node (pick a free port, e.g. {flag} 29501)") from None
