"""Bounds on the machine-shape options of every launcher, checked before anything starts.

A number a real machine or scheduler cannot meet either fails late (inside the job, after the queue)
or never (a job pending forever, a rendezvous waiting forever, the OOM killer): each is refused here
in one line, exit 2. Torch-free; the network checks are bounded in time.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import re
import shutil
import socket
import subprocess

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
HOST = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$|^\[?[0-9A-Fa-f:.]+\]?$")


def within(flag: str, value: int | None, low: int, high: int, example: str) -> None:
    """`flag` in low..high (None: not given, nothing to check)."""
    if value is not None and value < low:
        raise cli.error(f"{flag} must be >= {low}, got {value} (e.g. {flag} {example})")
    if value is not None and value > high:
        raise cli.error(f"{flag} must be at most {high}, got {value} (e.g. {flag} {example})")


def port(flag: str, value: int | None) -> None:
    if value is not None and not 1 <= value <= 65535:
        raise cli.error(f"{flag} must be a port number in 1..65535, got {value} (e.g. {flag} 29500)")


def cpu_worker_cap() -> int:
    """The most CPU worker processes this machine can run side by side."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(MIN_CPU_WORKERS, CPU_WORKERS_PER_CORE * cores)


def master_addr(flag: str, addr: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """A host name or address that resolves within timeout_s, else one line."""
    if not HOST.match(addr):
        raise cli.error(f"{flag} {addr[:80]!r} is not a host name or address (e.g. {flag} node0 or 10.0.0.1)")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(socket.getaddrinfo, addr.strip("[]"), None)
    try:
        future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise cli.error(f"{flag} {addr} did not resolve within {timeout_s:.0f} s (check the name and DNS)") from None
    except OSError as e:
        raise cli.error(
            f"{flag} {addr} does not resolve: {e.strerror or e} (pass node 0's host name or address)"
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


def slurm_node_cpus(partition: str | None, timeout_s: float = 10.0) -> int | None:
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
