"""Elastic node ranges: a job that runs on any node count from MIN to MAX, and keeps running on the nodes left.

    python -m launch.local --nnodes 1:2 --master-addr node0 --master-port 29500 --max-restarts 3 --config ...
    python -m launch.slurm --nodes 1-2 ...          (Slurm's own spelling of a node range)
    python -m launch.k8s --nodes 1:4 ...            (an elastic Indexed Job, or --jobset)

Why torchrun's c10d rendezvous with MIN:MAX and no node rank: the rendezvous hands out node ranks per
round, so a node that is lost (its ranks fail a collective or are ended by the hang watchdog) costs one
restart of the survivors' agents, which re-form the group on the nodes left (>= MIN) and restart the
worker, which resumes from the last committed checkpoint on the new world size (the global-step plan
keeps the global batch and the sample order). A node that comes back waits in the rendezvous; the
running agents see it at their next monitor tick and restart their workers with SIGTERM, which the
built-in worker treats as a preemption (all ranks agree on a step and commit a checkpoint, then exit),
so growing back loses no work. torchrun does not count such membership restarts against
--max-restarts; a lost node counts as one failure.

What torchrun's agent gives a worker to stop on a membership change (LocalElasticAgent._stop_workers ->
_shutdown: SIGTERM, then SIGKILL after 30 s, torch 2.14): the checkpoint of a preemption must fit in
that window, or the node that came back costs the steps since the last periodic checkpoint.

Where the rendezvous store lives: the TCP store is hosted by the agent on the --master-addr host that
binds the port first. Losing that host ends the rendezvous for every node (the survivors' agents cannot
re-form the group); that case is a full restart of the job, not a degraded one (see docs/launchers.md, Degraded restart).
A user's program with --run-dir has no such host: its nodes meet in the run dir (launch/rdzv_file.py).

Whose store it is: a second job given the same --master-addr/--master-port would otherwise join the
first job's store under its own rendezvous id, train on it, and die with it (a 109-line traceback and
exit 75 when the first job ended). Before starting torchrun, a launcher that finds a store listening there
asks it for its own rendezvous's key (`torch.rendezvous.<id>`, which torchrun's c10d backend writes the
moment it creates or joins the store); a store without it after STORE_WAIT_S belongs to another run and
is refused in one line (check_store, run by the agent's wrapper torchlaunch.launch.torchrun).

Torch-free at import: pure parsing and argv pieces, tested by golden files; check_store imports torch
only when a store is listening.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torchlaunch.base.untrusted import quote, whole
from torchlaunch.launch import cli
from torchlaunch.launch.shape import NodeRange

RDZV_KEYS = {
    "join_timeout": "s a node waits for MIN nodes to arrive (the last call comes on top; torchrun: 600)",
    "last_call_timeout": "s the group waits for more nodes once MIN are there (torchrun: 30)",
    "close_timeout": "s to close the rendezvous at the end (torchrun: 30)",
    "keep_alive_interval": "s between a node's heartbeats to the rendezvous (torchrun: 5)",
    "keep_alive_max_attempt": "missed heartbeats before a node counts as dead (torchrun: 3)",
}
"""The --rdzv-conf keys passed through to torchrun's c10d rendezvous, each a positive whole number."""
MAX_RDZV_VALUE = 86_400
DEFAULT_RDZV = {"keep_alive_interval": 2, "keep_alive_max_attempt": 3, "last_call_timeout": 10}
"""This launcher's rendezvous timeouts for elastic jobs, where torchrun's (5 s x 3 heartbeats, a 30 s last
call) kept a group that lost a node idle for ~65 s before its first step on the nodes left (bench.elastic,
2 loopback nodes): a lost node is now noticed after 6 s of missed heartbeats, and a group re-forms 10 s
after its first node is back in the rendezvous. --rdzv-conf overrides each."""
AGENT_STOP_GRACE_S = 30
"""torchrun's agent: SIGTERM to SIGKILL of its workers on a membership restart (not configurable from
torchrun's command line in torch 2.14); the preemption checkpoint must fit in it."""


def parse_rdzv_conf(text: str | None, defaults: dict[str, int] | None = None) -> tuple[tuple[str, int], ...]:
    """`--rdzv-conf k=v,k=v` (torchrun's option, the timeouts of the rendezvous only) over `defaults` ->
    sorted pairs; a key the launcher sets itself (is_host) or does not know is refused in one line."""
    pairs: dict[str, int] = dict(defaults or {})
    for item in text.split(",") if text else []:
        key, eq, value = item.strip().partition("=")
        if key not in RDZV_KEYS:
            known = ", ".join(RDZV_KEYS)
            raise cli.error(f"--rdzv-conf {key[:40]!r} is not a rendezvous setting of this launcher (one of {known})")
        number = whole(value.strip(), 9)
        if not eq or number is None or not 1 <= number <= MAX_RDZV_VALUE:
            raise cli.error(f"--rdzv-conf {key}={value[:20]!r}: must be a whole number 1..{MAX_RDZV_VALUE} ({key}=30)")
        pairs[key] = number
    return tuple(sorted(pairs.items()))


def torchrun_rendezvous(
    nodes: NodeRange, master_addr: str, port: int, rdzv_id: str, conf: tuple[tuple[str, int], ...] = ()
) -> list[str]:
    """torchrun's elastic rendezvous options (pure): no --node-rank (the rendezvous assigns it) and no
    is_host (the agent on the --master-addr host that binds the port first hosts the store, so any
    launcher on that host may be the one that starts first)."""
    argv = [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{master_addr}:{port}",
        "--rdzv-id",
        rdzv_id,
    ]
    if conf:
        argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in torchrun_conf(conf))]
    return argv


TORCHRUN_LAST_CALL_S = 30
"""torchrun's last_call_timeout when --rdzv-conf names none."""


def torchrun_conf(conf: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """Our rendezvous settings in torchrun's terms (pure). Ours: join_timeout is the wait for MIN nodes
    to arrive. torchrun's: the whole join, the last call after MIN included, so a join_timeout below
    last_call_timeout timed out every node though MIN had arrived (issue 52: `--nnodes 1:2 --rdzv-conf
    join_timeout=5,last_call_timeout=10` never started). The last call is added on top."""
    given = dict(conf)
    if "join_timeout" in given:
        given["join_timeout"] += given.get("last_call_timeout", TORCHRUN_LAST_CALL_S)
    return tuple(sorted(given.items()))


def job_key(rdzv_id: str, master_addr: str, port: int) -> str:
    """What makes launchers one elastic job on a run dir (the run-dir lock's `job`): the same rendezvous."""
    return f"elastic:{rdzv_id}@{master_addr}:{port}"


RENDEZVOUS_KEY = "torch.rendezvous."
"""torchrun's c10d rendezvous backend keeps a run's state under this prefix + the rendezvous id
(C10dRendezvousBackend, torch 2.14), set when its agent creates or first reaches the store."""
STORE_WAIT_S = 5.0
"""How long a store that is up may take to show this run's key: its host agent writes it right after
binding (a few ms), so only a store of another run stays without it."""


def listening(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at host:port (bounded; nothing is sent)."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_store(master_addr: str, port: int, rdzv_id: str, wait_s: float = STORE_WAIT_S) -> None:
    """An elastic agent's rendezvous store, if one is up already, must be its own job's: the store at
    master_addr:port holds `torch.rendezvous.<rdzv_id>` within `wait_s`, else one line, exit 2. Nothing
    listening there: this launcher's agent will host it. Something that is no store: torchrun says so."""
    if not listening(master_addr, port):
        return
    from torch.distributed import TCPStore  # only here: a store is up

    try:
        store = TCPStore(
            master_addr.strip("[]"), port, is_master=False, timeout=timedelta(seconds=wait_s), wait_for_workers=False
        )
    except (RuntimeError, ValueError):  # not a TCPStore (DistNetworkError is a RuntimeError)
        return
    try:
        store.wait([RENDEZVOUS_KEY + rdzv_id], timedelta(seconds=wait_s))
    except RuntimeError:  # DistStoreError: timed out
        raise cli.error(
            f"--master-addr {quote(master_addr, 80)} --master-port {port}: the rendezvous store there belongs to "
            f"another job (no rendezvous {quote(rdzv_id, 40)} in it after {wait_s:g} s); pass a --master-port "
            "no other job uses"
        ) from None
