"""A node agent's side of the membership service placed by the run dir (live/placement.py),
shared by launch.local's live agent (agent/live.py) and a Slurm job's tasks (the task of each
node's local rank 0: backends/slurm/live.py): a Lighthouse in standby on this node, and the lease that
says whether it serves. Why in agent/: it is live mode's node side; a Slurm task, one floor up, runs it too.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torchlaunch import roads, rundir
from torchlaunch.agent.live_shared import LOOPBACK
from torchlaunch.base.untrusted import whole

LIVE = roads.get("live")
"""live/placement.py and live/presence.py, reached through the live road (torchlaunch.roads)."""

POLL_S = 0.05
"""How often the agent looks at the lease: a small share of the lease's fifth between renewals."""


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_pair(tries: int = 64, host: str = LOOPBACK) -> int:
    """A free port on `host` whose next one is free too: the service's Lighthouse and its presence."""
    for _ in range(tries):
        port = free_port(host)
        if port >= 65535:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, LIVE.presence.port_of(port)))
            except OSError:
                continue
        return port
    raise SystemExit("live: found no two free ports in a row on loopback for the membership service")


class Placed:
    """The membership service of a job across nodes, placed on one of its nodes by the run dir's lease
    (live/placement.py): every node's agent holds a Lighthouse in standby and the lease's holder
    serves; when the holder's lease lapses (its node lost) another agent takes it and serves instead."""

    def __init__(self, lease: Any, standby: Any, nodes: int, nproc: int) -> None:
        self.lease, self.standby, self.nodes, self.nproc = lease, standby, nodes, nproc

    @classmethod
    def start(
        cls, run_dir: str | Path, heartbeat_timeout_ms: int, node_rank: int, nodes: int, nproc: int, host: str
    ) -> Placed:
        """This node's standby Lighthouse on `host` (the address the other nodes reach it on) and its
        side of the lease; node 0 takes a free lease at once, the others after the bound."""
        bind = f"[{host}]" if ":" in host else host
        port = free_port_pair(host=host)
        secret = str(rundir.live(run_dir) / "secret")  # the ranks make it; the service reads it when due
        log = rundir.logs(run_dir) / f"membership-node{node_rank}.log"
        standby = LIVE.placement.Standby(f"{bind}:{port}", heartbeat_timeout_ms, secret, log)
        standby.start()
        placed = cls(None, standby, nodes, nproc)  # type: ignore[arg-type]
        placed.lease = LIVE.placement.Lease(
            run_dir,
            f"{os.getpid()}-{secrets.token_hex(6)}",
            f"http://{bind}:{port}",
            heartbeat_timeout_ms / 1000,
            placed.serve,
            standby.stop,
            extra={"nproc": nproc},
            patience_s=0.0 if node_rank == 0 else heartbeat_timeout_ms / 1000,
        )
        return placed

    def serve(self, previous: dict) -> None:
        """This agent took the lease: serve, first awaiting the ranks left once the previous holder's
        node is gone (every node's ranks but its own; the first lease awaits one, as a service apart)."""
        lost = whole(str(previous.get("nproc", "")), 6)
        taken_over = lost is not None and not previous.get("released")
        awaited = max(1, self.nodes * self.nproc - lost) if taken_over and lost is not None else 1
        print(f"live: this node serves the membership service at {self.lease.address}", file=sys.stderr, flush=True)
        self.standby.serve(awaited)

    def wait_for_service(self) -> str:
        """The service's address once one serves (this node's, or another's seen renewing its lease)."""
        deadline = time.monotonic() + LIVE.placement.SERVICE_START_S + 2 * self.lease.lease_s
        while not self.lease.live:
            if time.monotonic() > deadline:
                raise SystemExit("live: no membership service came up on any node of the job")
            self.tick()
            time.sleep(POLL_S)
        return self.lease.live

    def tick(self) -> None:
        self.lease.tick()
        if self.lease.held and self.standby.keep_up(self.nodes * self.nproc):
            print("live: the membership service on this node exited; started again", file=sys.stderr, flush=True)

    def keep(self, done: threading.Event) -> None:
        """Tick until `done`, then leave cleanly: what a thread of a process that also trains runs (a
        Slurm task), where the launch.local agent ticks from its own loop."""
        try:
            while not done.wait(POLL_S):
                self.tick()
        finally:
            self.close()

    def close(self) -> None:
        self.lease.release()
        self.standby.close()


def await_service(run_dir: str | Path, timeout_s: float) -> str:
    """The service's address as a rank beside its node's agent waits for it: the newest lease's, once
    seen renewed (a lease an earlier launch left never is). It never takes the lease (no bound lapses)."""
    reader = LIVE.placement.Lease(run_dir, "reader", "", math.inf, lambda _: None, lambda: None, patience_s=math.inf)
    deadline = time.monotonic() + timeout_s
    while not reader.live:
        if time.monotonic() > deadline:
            raise SystemExit("live: no membership service came up on any node of the job")
        reader.tick()
        time.sleep(POLL_S)
    return reader.live
