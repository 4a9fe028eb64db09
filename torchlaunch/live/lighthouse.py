"""The membership seam backed by torchft's Lighthouse (the `live` extra: torchft==0.2.0).

Why the Lighthouse: it is a small service that forms a quorum from the replicas that ask and are
still heartbeating, refuses a group of half or fewer of the heartbeating replicas (no split brain),
and keeps only soft state, so it can run anywhere and be restarted. It runs in a process of its own
(`python -m torchlaunch.live.lighthouse`, started by the local launcher in live mode on one
node; `python -m launch.lighthouse` on a host of its own for a job across nodes), never inside a
training rank, so the loss of any rank or node, the first included, leaves it up.

It checks nothing, so it listens on loopback only (BACKEND_HOST, a port of its own), and the service's
address is a front (live/front.py) that admits a connection only once it proved the run's key;
each rank reaches it through a relay in its own process (LighthouseMembership).

What it lacks is written here: it hears of a lost rank only when its heartbeats lapse. Beside it, on
the next port, the service takes each seated rank's presence (live/presence.py): a rank's
connection that ends is a rank gone, and the service forgets it at once (Service, below).

What is used of torchft: LighthouseServer and LighthouseClient (heartbeat, quorum) only. Its Manager,
DDP wrapper and sampler are not: the trainer keeps its own exact plan and gradient averaging.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from torchlaunch.base import rules
from torchlaunch.base.untrusted import quote, whole
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, BadInput, LaunchParser
from torchlaunch.live import front, presence, private_net
from torchlaunch.live.membership import Member, Quorum, forming_bound_s, sorted_members, started_as

T = TypeVar("T")
HEARTBEATS_PER_TIMEOUT = 10
"""Heartbeats sent per heartbeat timeout: a live rank is never taken for lost by one late beat."""
CONNECT_TIMEOUT_S = 10.0
RETRY_S = 0.05
"""Pause between quorum requests to a service that did not answer (being restarted)."""
MOVED_QUORUM_S = 3.0
"""The shortest bound of one quorum request to a placed service (see quorum)."""
MOVE_CONNECT_S = 1.0
"""How long a member waits to connect to the service's new address (it listens before it is published)."""


BINDINGS = "torchft._torchft"
QUIET = ("RUST_LOG", "warn")
"""torchft's Rust logger reads RUST_LOG once, when its bindings load, and logs at INFO by default: a line
on every rank's stderr at each connection ("Creating LighthouseClient ..."), which live by default put in
every multi-rank run's output (and beside bad input's one line). Warnings and errors still show; a
RUST_LOG of the user's own wins."""


def _torchft():  # noqa: ANN202 - the module itself
    """torchft's bindings, or one line naming the extra to install.

    Loaded by themselves, without torchft's package, where that is not imported yet: the bindings are a
    Rust extension that links no libtorch, but the package's __init__ imports torch. The membership
    service's process used only these and paid for torch: measured 2.0 s of CPU and 720 MB resident
    against 0.02 s and 12 MB, at every start and restart of the service, which a live launcher waits
    for before it starts the ranks."""
    if BINDINGS in sys.modules:
        return sys.modules[BINDINGS]
    os.environ.setdefault(*QUIET)
    if "torchft" not in sys.modules and (bindings := _bindings_alone()) is not None:
        return bindings
    try:
        from torchft import _torchft
    except ImportError:
        from torchlaunch.exit_codes import ConfigError

        raise ConfigError(
            "recovery.live", "needs torchft, which is not installed", "pip install 'torchlaunch[live]'"
        ) from None
    return _torchft


def _bindings_alone():  # noqa: ANN202 - the module, or None: the caller imports the package then
    """torchft/_torchft*.so loaded as torchft._torchft without running torchft/__init__.py; registered in
    sys.modules, so a later import of the package reuses it (an extension initialises once a process)."""
    import importlib.machinery
    import importlib.util

    try:
        package = importlib.util.find_spec("torchft")
    except (ImportError, ValueError):
        return None
    for folder in (package.submodule_search_locations or []) if package is not None else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_torchft" + suffix)
            if not os.path.isfile(path):
                continue
            loader = importlib.machinery.ExtensionFileLoader(BINDINGS, path)
            spec = importlib.util.spec_from_file_location(BINDINGS, path, loader=loader)
            if spec is None:
                return None
            try:
                module = importlib.util.module_from_spec(spec)
                sys.modules[BINDINGS] = module
                loader.exec_module(module)
            except ImportError:
                sys.modules.pop(BINDINGS, None)  # the package's own import says what is wrong
                return None
            return module
    return None


def asked_until(call: Callable[[float], T], timeout_s: float) -> T:
    """`call(seconds left)` until it answers, or TimeoutError (its last error) once `timeout_s` passed.
    A service being restarted refuses connections for a moment, and the client's first call after a
    restart fails while it reconnects (measured, torchft 0.2.0; through the front the old connection's
    end takes two relays to reach the client, so it is met more often): the first failure is asked
    again at once, later ones after RETRY_S."""
    deadline = time.monotonic() + timeout_s
    failed = 0
    while True:
        try:
            return call(max(deadline - time.monotonic(), 0.1))
        except Exception as e:  # unreachable (retried) or timed out
            failed += 1
            if time.monotonic() + RETRY_S >= deadline:
                raise TimeoutError(str(e)) from None
            if failed > 1:
                time.sleep(RETRY_S)


class LighthouseMembership:
    """This rank's heartbeats to the Lighthouse and its presence beside it (a daemon thread), and its
    quorum requests."""

    def __init__(
        self,
        address: str,
        replica_id: str,
        heartbeat_timeout_s: float,
        presence_key: bytes | None = None,
        follow: Callable[[], str] | None = None,
    ) -> None:
        self.address, self.replica_id = address, replica_id
        self._follow = follow
        """Where the service is now ('' unknown), when a node agent hosts it (placement.Follow): read when
        the service stops answering, since the node that hosted it may be the one lost."""
        self._moving = threading.Lock()
        self.interval_s = heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT
        key = self._key = presence.key_from_env() or presence_key
        self._relay = front.connect(key, address)  # the service admits only proven connections
        self._client = _torchft().LighthouseClient(self._relay.address, timedelta(seconds=CONNECT_TIMEOUT_S))
        self._presence = presence.Presence(address, replica_id, key, speaks=started_as(replica_id) == 0)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """One heartbeat now (the service knows this rank before start() returns; asked again, as a quorum
        is, when the service restarted under it), then a thread."""
        asked_until(lambda left: self._client.heartbeat(self.replica_id, timedelta(seconds=left)), CONNECT_TIMEOUT_S)
        self._thread = threading.Thread(target=self._beat, name="torchlaunch-heartbeat", daemon=True)
        self._thread.start()

    def present(self) -> None:
        """This rank holds a seat in a group: the service counts it, and hears at once if it ends. The
        connection is made on the heartbeat thread (woken now), so a service that does not answer never
        holds a regroup up."""
        self._presence.want()
        self._wake.set()

    def _beat(self) -> None:
        while not self._stop.is_set():
            if self._wake.wait(self.interval_s):
                self._wake.clear()
                self._presence.beat()
                continue
            self._presence.beat()
            try:
                self._client.heartbeat(self.replica_id, timedelta(seconds=max(1.0, self.interval_s * 5)))
            except Exception:  # the service is restarting (the next beat reaches the new one) or moved
                self.follow()
                continue

    def follow(self) -> None:
        """The service did not answer: if a node agent hosts it and it moved to another node, use that
        one from now on (its client, and the presence connection)."""
        if self._follow is None or not self._moving.acquire(blocking=False):
            return
        try:
            moved = self._follow()
            if not moved or moved == self.address:
                return
            relay = front.connect(self._key, moved)  # the moved service admits only proven connections too
            try:
                client = _torchft().LighthouseClient(relay.address, timedelta(seconds=MOVE_CONNECT_S))
            except Exception:  # not serving yet: asked again at the next failure
                relay.close()
                return
            old, self._relay = self._relay, relay
            self._client, self.address = client, moved
            old.close()
            self._presence.move(moved)
            self._wake.set()
        finally:
            self._moving.release()

    def quorum(self, step: int, store_address: str, timeout_s: float) -> Quorum:
        """Ask until the service answers or `timeout_s` has passed (asked_until). A service a node agent
        hosts (placement.py) may vanish with its machine, sending nothing (no reset): each request is then
        bounded by a few heartbeat bounds and asked again, of the service the run dir names by then."""
        cap = max(MOVED_QUORUM_S, 3 * self.interval_s * HEARTBEATS_PER_TIMEOUT) if self._follow else timeout_s

        def ask(left: float):  # noqa: ANN202 - torchft's quorum answer
            try:
                return self._client.quorum(
                    replica_id=self.replica_id,
                    timeout=timedelta(seconds=max(min(left, cap), 0.1)),
                    store_address=store_address,
                    step=step,
                )
            except Exception:
                self.follow()
                raise

        try:
            found = asked_until(ask, timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"no live group within {timeout_s:g} s from {self.address}: {e}") from None
        members = [Member(p.replica_id, p.store_address, int(p.step)) for p in found.participants]
        created = found.created
        token = f"{found.quorum_id}-{created.seconds}.{created.nanos:09d}"
        return Quorum(int(found.quorum_id), token, sorted_members(members))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._presence.leave()
        self._relay.close()


DEFAULT_BIND = "0.0.0.0:29510"


def bind_address(text: str) -> str:
    """`--bind HOST:PORT`, checked whole (a host by rules.HOST, a port in 1..65535)."""
    host, _, port = text.rpartition(":")
    number = whole(port, 5)
    if not (rules.HOST.fullmatch(host) and number is not None and 0 < number < 65535):
        raise argparse.ArgumentTypeError(
            f"--bind must be HOST:PORT with a port in 1..65534 (presence takes the next), not {quote(text)}"
        )
    return text


def loopback(bind: str) -> bool:
    """Whether `bind` (HOST:PORT) listens on loopback only: no other host reaches it."""
    host = bind.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def bounded_whole(low: int, high: int, unit: str = "ms") -> Callable[[str], int]:
    """An option's parser: a whole number of `unit` in low..high (ASCII digits only), else its one line."""

    def parse(text: str) -> int:
        number = whole(text, len(str(high)))
        if number is None or not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number of {unit} in {low}..{high}, not {quote(text)}")
        return number

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = LaunchParser(
        prog="python -m launch.lighthouse",
        description="The live group's membership service (recovery.live): run it on a host of its own for "
        "a job across nodes and give its address to every node (recovery.lighthouse=http://HOST:PORT).",
    )
    parser.add_argument("--bind", type=bind_address, default=DEFAULT_BIND, help=f"HOST:PORT (default {DEFAULT_BIND})")
    parser.add_argument(
        "--min-ranks", type=bounded_whole(1, 1_000_000, "ranks"), default=1, help="smallest group that may train"
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=bounded_whole(10, 3_600_000),
        default=1000,
        help="a rank silent this long is lost (recovery.heartbeat_timeout_s x 1000)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=bounded_whole(0, 3_600_000),
        default=None,
        help="how long a quorum waits for a heartbeating rank that does not ask "
        "(default: twice the heartbeat timeout, at least 2000: what a stranger's heartbeats can hold it)",
    )
    parser.add_argument(
        "--tick-ms", type=bounded_whole(1, 60_000), default=20, help="how often the service checks for a quorum"
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help="the run's RUN_DIR/live/secret, where this host shares the run dir: a rank's presence must prove it",
    )
    parser.add_argument(
        "--await-ranks",
        type=bounded_whole(1, 1_000_000, "ranks"),
        default=None,
        help=argparse.SUPPRESS,  # a restarted service of a group of N (agent/live.py): Service
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help=argparse.SUPPRESS,  # placed by a node agent (live/placement.py): serve on its word
    )
    parser.add_argument(
        "--with-agent",
        action="store_true",
        help=argparse.SUPPRESS,  # a node agent's own service (agent/live.py): ends when its stdin closes
    )
    args = parser.parse_args(argv)
    if args.secret_file is None and presence.key_from_env() is None and not loopback(args.bind):
        raise BadInput(
            f"lighthouse error: --bind {quote(args.bind)} is reachable from other hosts, and without the run's key "
            "anyone there is admitted: give --secret-file RUN_DIR/live/secret (this host must share the run dir), "
            "or bind 127.0.0.1"
        )
    if args.join_timeout_ms is None:
        args.join_timeout_ms = join_timeout_ms(args.heartbeat_timeout_ms)
    return args


def join_timeout_ms(heartbeat_timeout_ms: int) -> int:
    """torchft's join timeout for this heartbeat bound: membership.forming_bound_s. torchft waits this long
    for every replica that heartbeats and does not ask for the quorum, so anyone who reaches the port can
    hold each quorum for it by heartbeating (its own default, 60 s, measured 53 s of recovery in issue 52);
    the run's own ranks ask within the heartbeat bound of each other, or are gone."""
    return round(forming_bound_s(heartbeat_timeout_ms / 1000) * 1000)


def secret_file_key(path: str | None) -> Callable[[], bytes | None] | None:
    """The presence key of the run whose secret is at `path` (runkey.RunKey.presence_key), read when a
    hello comes and kept once found: the service may start before the run's first rank made it. A file
    that is unsafe to read (a link, another user's, readable by others) is said once and never trusted."""
    if path is None:
        return None
    from torchlaunch.live import runkey

    found: list[bytes] = []
    refused: list[str] = []

    def key() -> bytes | None:
        if found or refused:
            return found[0] if found else None
        try:
            run = runkey.existing(path)
        except BadInput as e:
            refused.append(str(e))
            print(f"lighthouse: {str(e).splitlines()[0][:300]}: no presence is counted", file=sys.stderr, flush=True)
            return None
        if run is not None:
            found.append(run.presence_key)
        return found[0] if found else None

    return key


BACKEND_HOST = "127.0.0.1"
"""torchft's Lighthouse listens here only, on a port of its own: the service's address is its front
(live/front.py), which admits a connection only once it proved the run's key."""
REBIND_S = 5.0
"""How long a restart may wait for the address its previous server is releasing (measured: 1-2 ms)."""


class Service:
    """torchft's LighthouseServer on loopback behind the front on --bind (front.Front), restartable in
    place, and the ranks' presence on the next port. A restart is how a rank's loss is told to the Lighthouse: torchft 0.2.0 has no call to
    drop a member, and while the dead rank's last heartbeat is fresh it forms no group of half or fewer
    of those heartbeating, nor one that leaves a heartbeating rank out before join_timeout_ms, so the
    survivors would wait out the heartbeat timeout. Its state is soft, so a new server knows only the
    ranks that beat or ask after it started; it is started waiting for every rank still present (never
    fewer than --min-ranks), so it does not form a group of the first rank to ask back."""

    def __init__(self, args: argparse.Namespace, private: bool = False) -> None:
        """`private`: the Lighthouse in a network namespace of its own (private_net.move: this thread and
        the threads it starts); only for the service's own process, never one that serves anything else."""
        self.args = args
        self._lock = threading.Lock()
        self.restarts = 0
        self._min = max(args.min_ranks, args.await_ranks or 0)
        key = presence.key_from_env() or secret_file_key(args.secret_file)
        host, _, port = args.bind.rpartition(":")
        host = host.strip("[]")
        self.front = front.Front(key, (host, int(port)), self._target)  # listening, in the host's namespace
        try:
            self.presence = presence.PresenceServer(
                host, presence.port_of(int(port)), args.heartbeat_timeout_ms / 1000, self._changed, key=key
            )
        except OSError:
            self.front.close()
            raise
        self.shared_loopback = private_net.move() if private else "not asked for"
        """Why the Lighthouse listens on the host's loopback (None: on a loopback of its own)."""
        try:
            self._server = self._bind(self._min)
        except (RuntimeError, OSError):
            self.front.close()
            self.presence.close()
            raise
        self._since = time.monotonic()
        """When the server last (re)started: the ranks are given the bound to be present again."""
        self.front.start()
        self.presence.start()

    def _target(self) -> tuple[str, int]:
        """Where the front relays a proven connection: the Lighthouse now serving, on loopback."""
        with self._lock:
            return BACKEND_HOST, self._port

    def _bind(self, min_ranks: int):  # noqa: ANN202 - torchft's LighthouseServer
        deadline = time.monotonic() + REBIND_S
        while True:
            try:
                server = _torchft().LighthouseServer(
                    bind=f"{BACKEND_HOST}:{getattr(self, '_port', 0)}",  # a restart: the same port again
                    min_replicas=min_ranks,
                    join_timeout_ms=self.args.join_timeout_ms,
                    quorum_tick_ms=self.args.tick_ms,
                    heartbeat_timeout_ms=self.args.heartbeat_timeout_ms,
                )
                self._port = int(server.address().rpartition(":")[2])
                return server
            except (RuntimeError, OSError):
                if not getattr(self, "_server", None) or time.monotonic() > deadline:
                    raise  # the first bind reports at once; a restart waits for the old listener to close
                time.sleep(0.001)

    def _changed(self, events: list[tuple[str, str]]) -> None:
        """The presence thread's news, every 0.1 s at most: a rank gone is forgotten now; and a
        server that waits for more ranks than are present (one fell silent, or never came back after
        this service restarted) for longer than the bound starts again waiting for those present
        (torchft drops a lapsed heartbeat by itself, but not the count it was told to wait for). A
        restart that cannot listen again ends the process (exit FAILURE), which its keeper (the local
        agent, a Deployment) starts again, rather than leaving a process that serves nobody."""
        wanted = max(self.args.min_ranks, self.presence.alive())
        gone = [name for kind, name in events if kind == presence.LOST]
        waited = time.monotonic() - self._since > self.args.heartbeat_timeout_ms / 1000
        if not gone and not (wanted < self._min and waited):
            return
        try:
            self.restart(wanted)
        except (RuntimeError, OSError) as e:
            print(f"lighthouse: cannot listen again on {quote(self.args.bind)}: {quote(str(e))}", file=sys.stderr)
            os._exit(FAILURE)
        said = f"{', '.join(gone[:8])} gone (connection closed)" if gone else "fewer ranks present than awaited"
        print(f"lighthouse: {said}: serving again for the {wanted} rank(s) left", file=sys.stderr, flush=True)

    def restart(self, members: int) -> None:
        """Start again waiting for `members` ranks: every lost rank's heartbeat is forgotten now."""
        with self._lock:
            self._server.shutdown()
            self._min = max(1, members)
            self._server = self._bind(self._min)
            self._since = time.monotonic()
            self.restarts += 1

    def shutdown(self) -> None:
        self.presence.close()
        self.front.close()
        with self._lock:
            self._server.shutdown()


def stand_by(args: argparse.Namespace) -> bool:
    """--standby (placement.Standby): import torchft now, then wait for the node agent's word, a line
    with the count of ranks to await, before binding; False when the agent left first. From then on the
    service ends with its agent: its end of the pipe closes when the agent dies, however it died."""
    _torchft()
    line = sys.stdin.readline()
    if not line:
        return False
    count = whole(line.strip(), 7)
    args.await_ranks = max(1, count or 1)
    end_with_agent()
    return True


def end_with_agent() -> None:
    """End when the node agent that started this service is gone: its end of the stdin pipe closes when
    it dies, however it died (a SIGKILLed agent runs no clean-up, and an orphaned service would hold
    its port and the run's quorums)."""

    def with_agent() -> None:
        while sys.stdin.readline():
            pass
        os._exit(0)

    threading.Thread(target=with_agent, name="torchlaunch-agent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the state is soft, so a restart on the same address is a new service
    that the ranks' next heartbeats and quorum requests fill again. Bad arguments or an address it
    cannot listen on: one line, exit 2."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.standby and not stand_by(args):
            return 0
        if args.with_agent:
            end_with_agent()
        try:
            server = Service(args, private=True)
        except (RuntimeError, OSError) as e:
            raise BadInput(f"lighthouse error: cannot listen on {quote(args.bind)}: {quote(str(e))}") from None
    except BadInput as problem:
        print(str(problem).replace("\n", " ")[:2000], file=sys.stderr, flush=True)
        return BAD_INPUT
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    keyed = server.presence.key is not None
    print(
        f"lighthouse: serving {args.bind}, presence on port {server.presence.port} "
        f"(heartbeat timeout {args.heartbeat_timeout_ms} ms, join timeout {args.join_timeout_ms} ms); "
        + (
            "connections and presence admitted only with the run's key"
            + (
                ", torchft's Lighthouse on a loopback of its own"
                if server.shared_loopback is None
                else f", torchft's Lighthouse on this host's loopback ({server.shared_loopback}): a process on this "
                "host that finds its port can hold quorums up"
            )
            if keyed
            else "connections admitted and presence ids taken at their word: a stranger on this host can hold "
            "a regroup up; give --secret-file RUN_DIR/live/secret where this host shares the run dir"
        ),
        file=sys.stderr,
        flush=True,
    )
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
