"""Where a live job across nodes runs its membership service: on one of its own nodes, chosen by a
lease in the run dir, moved to another node when that one is lost. Nobody starts it by hand.

Why the run dir: every node of a live job shares it already (the group generation, the join
requests, the checkpoints), so it can arbitrate who hosts the service without a host of its own,
as a quorum disk does in an HA cluster. RUN_DIR/live/service/lease-<G>.json is generation G's lease:

- **Taken** by creating the file with O_CREAT | O_EXCL. Exclusive create is decided by the file server
  (NFSv3 EXCLUSIVE create, NFSv4 OPEN4 EXCLUSIVE, a local kernel), so of the agents that try G+1 at
  once exactly one succeeds, without a lock that a dead holder could leave held (flock on NFS is a
  server lock lease the server keeps for its own lease time, ~90 s, after a client dies).
- **Renewed** by its holder, the node agent whose Lighthouse serves, every lease_s / 5: the file's
  content (a beat counter) is replaced by rename, so a reader sees the old or the new content whole.
- **Lapsed** when a reader has seen the same content for lease_s by its own monotonic clock: no
  comparison of clocks across hosts. Each read opens the file again, which NFS's close-to-open
  consistency revalidates with the server; a mount with a longer attribute cache than lease_s
  (`actimeo`, `noac` off with a long `acregmin`) would make renewals look missing: takeovers too early,
  each ended by the step-down below.
- **Stepped down from** by a holder that could not renew for lease_s / 2, or that sees a newer lease:
  it stops serving (its Lighthouse process ends), before any reader can take the lease. A holder cut
  off from the run dir thus stops its service, and the side of a partition that cannot reach the run
  dir has no service to form a group with.

The address of the service is in the lease (the holder's Lighthouse, started before the lease was
tried, so a takeover costs no start-up: `Standby`); members read the newest lease's address when their
service stops answering (`Follow`). Groups stay fenced by the group generation (fence.py): a group a
stale service formed is superseded by the next one and can commit nothing.

Torch-free: the node agent runs it; the ranks read the address only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.base import procs

FOLDER = "service"
"""RUN_DIR/live/service: the leases."""
_NAME = re.compile(r"lease-(\d{9})\.json")
RENEWS_PER_LEASE = 5
STEP_DOWN_SHARE = 0.5
"""A holder that could not renew for this share of lease_s stops serving: readers wait a whole lease_s."""
KEEP = 2
"""Leases kept behind the newest (the rest are removed by the holder that took the newest)."""
MAX_LEASE_BYTES = 4096


def folder_of(run_dir: str | Path) -> Path:
    return rundir.live(run_dir) / FOLDER


def _path(folder: Path, generation: int) -> Path:
    return folder / f"lease-{generation:09d}.json"


def newest(folder: Path) -> int:
    """The newest lease's generation (0: none taken yet)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    found = [int(m.group(1)) for n in names if (m := _NAME.fullmatch(n))]
    return max(found, default=0)


def read(folder: Path, generation: int) -> bytes | None:
    """Lease `generation`'s content as stored (b'' between its creation and its first write), None if
    absent. Opened afresh each time (close-to-open: the server is asked), never through a link."""
    try:
        fd = os.open(_path(folder, generation), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.read(fd, MAX_LEASE_BYTES)
    finally:
        os.close(fd)


def fields(content: bytes | None) -> dict:
    """A lease's fields, {} for an unreadable or half-written one."""
    try:
        found = json.loads(content or b"")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def address(run_dir: str | Path) -> str:
    """The service's address as the newest lease holding one gives it ('' if none): what a member
    reads when its service stops answering. A released lease (its holder left cleanly) names none."""
    folder = folder_of(run_dir)
    top = newest(folder)
    for generation in range(top, max(0, top - KEEP - 1), -1):
        found = fields(read(folder, generation))
        if found.get("address") and not found.get("released"):
            return str(found["address"])[:200]
    return ""


@dataclass
class Seen:
    """What a reader saw of the newest lease, and since when (its own monotonic clock)."""

    generation: int = -1
    content: bytes | None = None
    since: float = 0.0


class Lease:
    """One node agent's side: take the lease when it is free or lapsed, renew it while held, step down
    when it cannot. `serve(address_wanted)` is called once the lease is this agent's; `stop()` when it
    is not any more (the agent's service stops answering: its members follow the next lease)."""

    def __init__(
        self,
        run_dir: str | Path,
        holder: str,
        address: str,
        lease_s: float,
        serve: Callable[[dict], None],
        stop: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        extra: dict | None = None,
        patience_s: float = 0.0,
    ) -> None:
        self.folder = folder_of(run_dir)
        self.holder, self.address, self.lease_s = holder, address, lease_s
        self._serve, self._stop, self._clock = serve, stop, clock
        self.patience_s = patience_s
        """How long a free lease (none yet, or released) is left to others first: node 0 gives none, so
        that it hosts the service as it hosts the first group's store, unless it is not there."""
        self.extra = dict(extra or {})
        """Written into each lease: what a node that takes over after this one needs (its ranks per node)."""
        self.held = 0
        """The generation this agent holds (0: none)."""
        self.live = ""
        """The service's address once known to serve: this agent's own while it holds the lease, else the
        newest lease's once seen renewed (a lease left by an earlier launch of the run dir never is)."""
        self._beat = 0
        self._renewed = 0.0
        self._seen = Seen()

    def tick(self) -> None:
        """One look (the agent's loop calls it every few tens of ms): renew, step down, or take over."""
        now = self._clock()
        top = newest(self.folder)
        if self.held:
            if top > self.held:
                self._step_down(f"lease {top} was taken by another node")
            elif now - self._renewed >= self.lease_s / RENEWS_PER_LEASE:
                self._renew(now)
            if self.held and now - self._renewed > self.lease_s * STEP_DOWN_SHARE:
                self._step_down(f"could not renew the lease for {now - self._renewed:.1f} s")
            return
        content = read(self.folder, top) if top else None
        if top != self._seen.generation or content != self._seen.content:
            if top == self._seen.generation and content and fields(content).get("address"):
                self.live = str(fields(content)["address"])[:200]  # renewed while this agent looked
            self._seen = Seen(top, content, now)
        waited = now - self._seen.since
        unheld = top == 0 or fields(content).get("released")
        free = waited >= self.patience_s if unheld else waited >= self.lease_s
        if free:
            self._take(top + 1, fields(content), now)

    def _take(self, generation: int, previous: dict, now: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(_path(self.folder, generation), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            return  # another agent took it: the next tick reads its lease
        os.close(fd)
        self.held, self._beat = generation, 0
        self._serve(previous)  # listening before its address is published (a member's connect retries)
        self._renew(now)
        self.live = self.address
        for old in range(max(1, generation - 64), generation - KEEP):
            with contextlib.suppress(OSError):
                _path(self.folder, old).unlink()

    def _renew(self, now: float) -> None:
        self._beat += 1
        try:
            self._write(
                {
                    **self.extra,
                    "generation": self.held,
                    "holder": self.holder,
                    "address": self.address,
                    "beat": self._beat,
                }
            )
        except OSError:
            return  # tried again at the next tick; stepped down after STEP_DOWN_SHARE of the lease
        self._renewed = now

    def _write(self, value: dict) -> None:
        path = _path(self.folder, self.held)
        rundir.write_bytes(path, json.dumps(value).encode(), tmp=path.with_name(f".{path.name}.{self.holder}.tmp"))

    def _step_down(self, why: str) -> None:
        print(f"live: the membership service on this node stops ({why})", file=sys.stderr, flush=True)
        self.held = 0
        self.live = ""
        self._seen = Seen()
        self._stop()

    def release(self) -> None:
        """Leaving cleanly: the lease is marked released, so another node takes it at once."""
        if self.held:
            with contextlib.suppress(OSError):
                self._write({"generation": self.held, "holder": self.holder, "released": True})
            self.held = 0


SERVICE_START_S = 30.0


class Standby:
    """This node's Lighthouse process, started at once with torchft imported (~1.5 s of imports) and
    waiting, unbound, for the word to serve: a takeover then costs a bind, not a start-up. The one
    place a node agent starts the service (start_service), so that a front before it can be swapped in."""

    def __init__(self, bind: str, heartbeat_timeout_ms: int, secret_file: str, log: Path) -> None:
        self.bind, self.heartbeat_timeout_ms, self.secret_file = bind, heartbeat_timeout_ms, secret_file
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.serving = False

    def start(self) -> None:
        self.proc = start_service(self.bind, self.heartbeat_timeout_ms, self.secret_file, self.log)
        self.serving = False

    def serve(self, await_ranks: int) -> None:
        """Bind and serve, waiting first for `await_ranks` ranks (the Lighthouse's own rule then drops
        the count to the ranks present after the heartbeat bound)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{max(1, await_ranks)}\n".encode())
            self.proc.stdin.flush()
        except OSError:
            return  # it died: keep_up starts it again
        self.serving = True

    def keep_up(self, await_ranks: int) -> bool:
        """A serving process that died is started and served again; True if it was."""
        if self.proc is not None and self.proc.poll() is not None:
            was = self.serving
            self.start()
            if was:
                self.serve(await_ranks)
            return was
        return False

    def stop(self) -> None:
        """Stop serving (a lost lease) and stand by again."""
        self.close()
        self.start()

    def close(self) -> None:
        procs.end(self.proc)
        self.serving = False


def start_service(bind: str, heartbeat_timeout_ms: int, secret_file: str, log: Path) -> subprocess.Popen:
    """torchft's Lighthouse with presence (live/lighthouse.py) in standby on `bind`, keyed by
    the run's secret: it serves once a line with the count of ranks to await reaches its stdin. Its
    output (torchft logs each quorum's status) goes to `log`, never to a pipe nobody may read."""
    argv = [
        sys.executable,
        "-m",
        "torchlaunch.live.lighthouse",
        "--bind",
        bind,
        "--heartbeat-timeout-ms",
        str(heartbeat_timeout_ms),
        "--secret-file",
        secret_file,
        "--standby",
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_CREAT | os.O_APPEND | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=fd, stderr=fd)
    finally:
        os.close(fd)


class Follow:
    """A member's way to the service's current address: the newest lease's, read when the service it
    used stops answering; at most once per `every_s`, so a dead service costs a file read a beat."""

    def __init__(self, run_dir: str | Path, every_s: float = 0.05) -> None:
        self.run_dir, self.every_s = run_dir, every_s
        self._last = 0.0

    def __call__(self) -> str:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return ""
        self._last = now
        try:
            return address(self.run_dir)
        except OSError:
            return ""
