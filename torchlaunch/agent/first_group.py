"""`launch.local --nnodes MIN:MAX` in live mode: which nodes form the first live group, and that a node
arriving after it joins that group instead of forming one of its own.

Each node's launcher runs the same command with its own `--node-rank`. Before its live agent starts
anything, the launcher arrives in the run dir (RUN_DIR/live/arrived-<token>.json: its node rank and the
address its stores are reached on) and waits for the first group to be sealed
(RUN_DIR/live/first-group.json). Whichever launcher first sees MAX node ranks arrived, or at least MIN
of them for the last-call window (`--rdzv-conf last_call_timeout=S`, the elastic rendezvous's own knob,
10 s by default), seals the nodes arrived so far, under RUN_DIR/live/first-group.lock. The sealed
nodes' ranks form the first group by torchrun's env contract (node ranks in order -> seats 0..W-1, the
first sealed node's address hosts its store); from then on membership is the live group's (the
Lighthouse). A launcher that finds a seal without itself starts its ranks as joiners: they are
admitted at the group's next check point with a live peer's state, as a replaced node's are.

Why the run dir and not torchrun's rendezvous: the live agent numbers ranks by --node-rank (a rank's
files and its replica id follow it), and every node of a live job shares the run dir already (the
fence's generation, the join requests). Why launcher tokens rather than a clean-up: an arrival or a seal
is current only while one of its launchers is alive (runlock's node slots say which), so a previous
launch's files are ignored where they lie, and no clean-up can race a node that arrives meanwhile. The
seal also lists the launchers that joined since, so a job that trains on a late node alone is still
"this job" to a node that comes back: it joins, and never seals a group of its own beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.base.untrusted import load_json
from torchlaunch.launch.shape import NodeRange

SEAL = "first-group.json"
SEAL_LOCK = "first-group.lock"
ARRIVED = "arrived-"
POLL_S = 0.1
"""How often a waiting launcher looks at the run dir (a few file reads)."""
JOIN_TIMEOUT_S = 600
"""How long a node waits for MIN nodes when --rdzv-conf names no join_timeout (torchrun's default)."""


@dataclass(frozen=True)
class Arrival:
    """One node's launcher, waiting for the first group."""

    node: int
    host: str
    """The address the other nodes reach this node's stores on (live_shared.store_host)."""
    token: str
    """The launcher's runlock token: the arrival counts while that launcher is alive."""
    time: float = 0.0


@dataclass(frozen=True)
class Sealed:
    """The first group: its nodes by node rank, the launchers that joined it since, and the run dir's
    generation when it was sealed (the group's forming takes the next one)."""

    nodes: tuple[Arrival, ...]
    joined: tuple[str, ...] = ()
    generation: int = 0

    def tokens(self) -> set[str]:
        return {a.token for a in self.nodes} | set(self.joined)

    def seat(self, token: str) -> FirstSeat | None:
        """This launcher's place in the first group, or None when it was not sealed into it."""
        for index, arrival in enumerate(self.nodes):
            if arrival.token == token:
                return FirstSeat(index, len(self.nodes), self.nodes[0].host, tuple(a.node for a in self.nodes))
        return None


@dataclass(frozen=True)
class FirstSeat:
    """A node of the first group: its seat (its ranks are seat x ranks per node + local rank there),
    the group's node count, and the host of its store (seat 0's)."""

    seat: int
    nodes: int
    master_host: str
    node_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Joins:
    """A node that came after the first group was sealed: its ranks join the live group."""

    generation: int
    """The run dir's generation when the group was sealed: it has formed once the generation is past."""
    node_ranks: tuple[int, ...] = ()


def distinct(arrivals: Iterable[Arrival]) -> tuple[Arrival, ...]:
    """One arrival per node rank (the earliest: a second launch of a node joins, and is refused there
    as a second one), by node rank (pure)."""
    first: dict[int, Arrival] = {}
    for a in sorted(arrivals, key=lambda a: (a.time, a.token)):
        first.setdefault(a.node, a)
    return tuple(first[n] for n in sorted(first))


def ready(arrived: int, nodes: NodeRange, min_since: float | None, now: float, last_call_s: float) -> bool:
    """Whether the first group may be sealed (pure): every node of the range arrived, or at least MIN
    for the last-call window (counted from when this launcher first saw MIN)."""
    if arrived >= nodes.max:
        return True
    return arrived >= nodes.min and min_since is not None and now - min_since >= last_call_s


def current(sealed: Sealed | None, live: set[str]) -> bool:
    """Whether a seal is this job's (one of its launchers alive) rather than a previous launch's."""
    return sealed is not None and bool(sealed.tokens() & live)


class Meeting:
    """The first-group rendezvous of one launcher in RUN_DIR/live."""

    def __init__(self, folder: Path, me: Arrival, live: Callable[[], set[str]], generation: Callable[[], int]) -> None:
        self.folder, self.me = folder, me
        self.live = live
        """The tokens of the job's launchers alive now, this one included (runlock's node slots)."""
        self.generation = generation
        """The run dir's group generation now (live/fence.py)."""

    def meet(
        self,
        nodes: NodeRange,
        last_call_s: float,
        join_timeout_s: float,
        stopped: Callable[[], bool] = lambda: False,
    ) -> FirstSeat | Joins | None:
        """Arrive and wait for the first group: this node's seat in it, Joins when it was sealed without
        this node, None when a stop signal came first. TimeoutError when fewer than MIN nodes arrived
        within `join_timeout_s`; once MIN are there the last call runs to its end whatever is left of
        that wait (a join_timeout below last_call_s timed out a job whose MIN had arrived: issue 52)."""
        self.folder.mkdir(exist_ok=True)
        rundir.write_json(self.folder / f"{ARRIVED}{self.me.token}.json", arrival_record(self.me), durable=False)
        deadline = time.monotonic() + join_timeout_s
        min_since: float | None = None
        try:
            while not stopped():
                decided, arrived = self._look(nodes, min_since, last_call_s)
                if decided is not None:
                    return decided
                if arrived >= nodes.min and min_since is None:
                    min_since = time.monotonic()
                elif arrived < nodes.min:
                    min_since = None  # one of MIN left before the seal: the join's deadline holds again
                if time.monotonic() >= deadline and min_since is None:  # MIN arrived: the last call runs on
                    raise TimeoutError(
                        f"{arrived} of the {nodes.min} node(s) needed arrived within {join_timeout_s:g} s"
                    )
                time.sleep(POLL_S)  # other launchers' files: there is no event to wait on across hosts
            return None
        finally:
            (self.folder / f"{ARRIVED}{self.me.token}.json").unlink(missing_ok=True)

    def _look(
        self, nodes: NodeRange, min_since: float | None, last_call_s: float
    ) -> tuple[FirstSeat | Joins | None, int]:
        """Under the lock: the decision if the first group is sealed (or may be sealed now), and how many
        node ranks have arrived."""
        with self._locked():
            live = self.live() | {self.me.token}
            sealed = self._read_seal()
            if sealed is not None and current(sealed, live):
                return self._decide(sealed), len(sealed.nodes)
            arrived = distinct(a for a in self._arrivals() if a.token in live)
            if not ready(len(arrived), nodes, min_since, time.monotonic(), last_call_s):
                return None, len(arrived)
            sealed = Sealed(arrived, (), self.generation())
            rundir.write_json(self.folder / SEAL, seal_record(sealed), durable=True)
            self._forget_stale(live)
            return self._decide(sealed), len(arrived)

    def _decide(self, sealed: Sealed) -> FirstSeat | Joins:
        """This launcher's seat, or Joins (recorded in the seal, so the job stays current while it lives)."""
        seat = sealed.seat(self.me.token)
        if seat is not None:
            return seat
        if self.me.token not in sealed.joined:
            joined = Sealed(sealed.nodes, (*sealed.joined, self.me.token), sealed.generation)
            rundir.write_json(self.folder / SEAL, seal_record(joined), durable=True)
        return Joins(sealed.generation, tuple(a.node for a in sealed.nodes))

    def wait_formed(self, joins: Joins, timeout_s: float, stopped: Callable[[], bool] = lambda: False) -> bool:
        """Wait (bounded) until the first group has formed (the generation is past the seal's), so this
        node's ranks never ask the service for a group while the first group's ranks ask for their first
        one. False when it did not form in time (the joiners' own quorum timeout bounds them then)."""
        deadline = time.monotonic() + timeout_s
        while self.generation() <= joins.generation:
            if stopped() or time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _arrivals(self) -> list[Arrival]:
        found = []
        for path in sorted(self.folder.glob(f"{ARRIVED}*.json"))[:10_000]:
            arrival = read_arrival(path)
            if arrival is not None:
                found.append(arrival)
        return found

    def _read_seal(self) -> Sealed | None:
        try:
            return parse_seal((self.folder / SEAL).read_bytes())
        except FileNotFoundError:
            return None

    def _forget_stale(self, live: set[str]) -> None:
        """Arrivals of launchers no longer alive (a previous launch's): removed when a group is sealed."""
        for path in self.folder.glob(f"{ARRIVED}*.json"):
            arrival = read_arrival(path)
            if arrival is None or arrival.token not in live:
                path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.folder / SEAL_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def arrival_record(a: Arrival) -> dict[str, object]:
    return {"node": a.node, "host": a.host, "token": a.token, "time": a.time}


def seal_record(s: Sealed) -> dict[str, object]:
    return {"nodes": [arrival_record(a) for a in s.nodes], "joined": list(s.joined), "generation": s.generation}


def read_arrival(path: Path) -> Arrival | None:
    try:
        return parse_arrival(load_json(path.read_bytes()[:4096]))
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # being written, or gone: read again at the next poll


def parse_arrival(data: object) -> Arrival | None:
    """An arrival record, or None when it is not one (pure)."""
    if not isinstance(data, dict):
        return None
    node, host, token, when = data.get("node"), data.get("host"), data.get("token"), data.get("time", 0.0)
    if not (
        isinstance(node, int) and isinstance(host, str) and isinstance(token, str) and isinstance(when, float | int)
    ):
        return None
    return Arrival(node, host, token, float(when))


def parse_seal(raw: bytes) -> Sealed | None:
    """The seal record, or None when it cannot be read as one (pure; a damaged seal counts as none)."""
    try:
        data = load_json(raw[:1_000_000])
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    listed, joined, generation = data.get("nodes"), data.get("joined", []), data.get("generation", 0)
    if not isinstance(listed, list) or not isinstance(joined, list) or not isinstance(generation, int):
        return None
    nodes = [parse_arrival(n) for n in listed]
    found = tuple(n for n in nodes if n is not None)
    if not found or len(found) != len(nodes):
        return None
    return Sealed(found, tuple(str(t) for t in joined), generation)
