"""A seated rank's presence at the membership service: one TCP connection held open while it lives.

Why: torchft's Lighthouse learns of a lost rank only when its heartbeats lapse, and while the dead
rank's last beat is fresh it forms no group of the survivors (half or fewer of those heartbeating, or
stragglers to wait for), so across nodes every crash cost recovery.heartbeat_timeout_s. But a process's
sockets are closed by its kernel when it ends, whatever ended it (SIGKILL, the OOM killer, a crash,
every process of a node killed at once): the service, at the other end of this connection, sees the
end at once. That end is the fact; the survivors' own transport error is the same fact on their side.
No rank vouches for another (a survivor's "connection reset" may come from a live peer shutting a
broken group down); the service hears it from the dead rank's own kernel.

A connection that goes quiet instead (a frozen node, a cut cable) sends nothing: its beats lapse
after the same bound as the heartbeats, as before. A connection closed while its rank lives (the
service restarted, a middlebox) costs nothing but the wait it saves: the rank connects again.

Only a rank seated in a group is present (LiveGroup calls its membership's present() once a group
formed): a rank still
starting, or started again and waiting to be admitted, is not counted among those the next group waits
for, so a regroup never waits for one.

The wire, one ASCII line each, at most LINE_MAX bytes: the service says `challenge <nonce>` as it
accepts (`challenge <nonce> keyed` when it counts only proven hellos); the rank answers `hello <replica id> <proof>` once (the proof: an HMAC of the nonce and the id
under the launch's presence key), then `beat` every heartbeat interval, `bye` before it leaves on
purpose. Anything else closes the connection and counts as nobody's loss.

Why a proof: anything that reaches the port could say hello with any id, and the service counted it
(issue 52: 20 forged ids held a regroup until the job failed; a hello then a close restarted the
service at will). A service given the key (TORCHLAUNCH_LIVE_PRESENCE_KEY in its environment, which only
its owner can read: the local agent makes one per launch for the service it runs and its ranks) counts
only hellos that prove it; a forged one is closed and is nobody's loss. A service without a key (one
started apart, `python -m launch.lighthouse`, without `--secret-file`: on loopback only, lighthouse.py
refuses it elsewhere) takes the id at its word: a rank holding a key that meets one says so in one line
(the launch's rank 0 only), as a stranger's ids can then make a regroup wait for ranks that do not exist.
Torch-free and torchft-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import resource
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torchlaunch import contract
from torchlaunch.base import rules

LINE_MAX = 128
KEY_ENV = contract.LIVE_PRESENCE_KEY
PROOF_HEX = 32
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)
CONNECT_TIMEOUT_S = 1.0
HELLO_WITHIN_S = 5.0
"""A connection that has not said who it is by then is closed: a silent one holds no descriptor long."""


def connection_cap() -> int:
    """Connections beyond this are closed as they come: below the process's descriptor limit, so that
    accepting never fails for want of one (a listener that cannot accept stays readable, and the loop
    would spin)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(65_536, (soft if soft > 0 else 1024) - 64))


def key_from_env(env: dict[str, str] | None = None) -> bytes | None:
    """The presence key in the environment (KEY_ENV: 64 hex digits), or None when unset or malformed."""
    text = (os.environ if env is None else env).get(KEY_ENV, "")
    if len(text) != 64:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def proof(key: bytes, nonce: str, replica_id: str) -> str:
    """The answer to the service's challenge: good for that connection's nonce and that id only."""
    return hmac.new(key, f"presence\x00{nonce}\x00{replica_id}".encode(), hashlib.sha256).hexdigest()[:PROOF_HEX]


LOST = "lost"
LAPSED = "lapsed"


def port_of(lighthouse_port: int) -> int:
    """The presence port of a service whose Lighthouse listens on `lighthouse_port`: the next one.
    A convention, so that recovery.lighthouse=http://HOST:PORT stays the one address a user gives."""
    return lighthouse_port + 1


def address_of(lighthouse: str) -> tuple[str, int] | None:
    """(host, presence port) of an http://HOST:PORT Lighthouse address, or None."""
    found = rules.service_address(lighthouse)
    if found is None or found[1] >= 65535:
        return None
    return found[0], port_of(found[1])


@dataclass
class Board:
    """Who is present, and since when they last beat (pure bookkeeping: the server's, unit-tested
    without sockets). A replica id held by a newer connection is not lost with an older one."""

    bound_s: float
    beats: dict[str, tuple[int, float]] = field(default_factory=dict)
    """replica id -> (connection key, monotonic time of its last line)."""
    quiet: set[str] = field(default_factory=set)
    """Ids reported lapsed and not heard from since."""

    def hello(self, replica_id: str, key: int, now: float) -> None:
        self.beats[replica_id] = (key, now)
        self.quiet.discard(replica_id)

    def beat(self, replica_id: str, key: int, now: float) -> None:
        if self.beats.get(replica_id, (None, 0.0))[0] == key:
            self.beats[replica_id] = (key, now)
            self.quiet.discard(replica_id)

    def leave(self, replica_id: str, key: int) -> bool:
        """The connection `key` of `replica_id` ended; True when it was the id's current one."""
        if self.beats.get(replica_id, (None, 0.0))[0] != key:
            return False
        del self.beats[replica_id]
        self.quiet.discard(replica_id)
        return True

    def alive(self, now: float) -> int:
        """Ranks present and heard from within the bound."""
        return sum(1 for _, last in self.beats.values() if now - last <= self.bound_s)

    def newly_lapsed(self, now: float) -> list[str]:
        """Ids whose last line is older than the bound and were not reported yet."""
        found = [r for r, (_, last) in self.beats.items() if now - last > self.bound_s and r not in self.quiet]
        self.quiet.update(found)
        return found


class PresenceServer:
    """Accepts presence connections on (host, port) and tells `changed`, on its own thread, of the losses
    (a present rank's connection ended without `bye`) and lapses (no line within the bound) each pass
    of its loop found (every tenth of the bound or 0.1 s, news or none): ranks killed together are one call, so
    the service restarts once for them."""

    def __init__(
        self,
        host: str,
        port: int,
        bound_s: float,
        changed: Callable[[list[tuple[str, str]]], None],
        key: bytes | Callable[[], bytes | None] | None = None,
    ) -> None:
        self.board = Board(bound_s)
        self.key = key
        """The presence key a hello must prove (None: ids are taken at their word); a callable gives it once
        it exists (the run's secret, made by its first rank): until then no hello is counted."""
        self._nonces: dict[int, str] = {}
        self.changed = changed
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._names: dict[int, str] = {}
        self._buffers: dict[int, bytes] = {}
        self._opened: dict[int, tuple[socket.socket, float]] = {}
        """Connections not named yet, and when they were accepted."""
        self._cap = connection_cap()
        self._events: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._tick_s = min(max(bound_s / 10, 0.005), 0.1)
        self._thread = threading.Thread(target=self._serve, name="torchlaunch-presence", daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> int:
        with self._lock:
            return self.board.alive(time.monotonic())

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=2.0)
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=self._tick_s):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn, _ in [v for v in self._opened.values() if now - v[1] > HELLO_WITHIN_S]:
                self._drop(conn, lost=False)
            with self._lock:
                self._events += [(LAPSED, r) for r in self.board.newly_lapsed(now)]
            events, self._events = self._events, []
            self.changed(events)  # every pass, news or not: the service also judges by the count

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            conn, _ = self._listener.accept()
            if len(self._selector.get_map()) > self._cap:
                conn.close()
                return
            conn.setblocking(False)
            nonce = secrets.token_hex(16)
            try:
                said = f"challenge {nonce}{KEYED if self.key is not None else ''}\n"
                conn.send(said.encode("ascii"))  # a fresh socket's buffer takes 48 bytes
            except OSError:
                conn.close()
                return
            self._nonces[conn.fileno()] = nonce
            self._buffers[conn.fileno()] = b""
            self._opened[conn.fileno()] = (conn, time.monotonic())
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        key = conn.fileno()
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, lost=True)
            return
        buffer = self._buffers.get(key, b"") + data
        *lines, rest = buffer.split(b"\n")
        if len(rest) > LINE_MAX:
            self._drop(conn, lost=False)
            return
        self._buffers[key] = rest
        for line in lines:
            if not self._take(conn, line):
                return

    def _take(self, conn: socket.socket, line: bytes) -> bool:
        """One line from `conn`; False when the connection was dropped for it."""
        key, now = conn.fileno(), time.monotonic()
        word, _, rest = line.decode("ascii", "replace").strip().partition(" ")
        name = self._names.get(key)
        replica_id, _, answer = rest.partition(" ")
        if (
            word == "hello"
            and name is None
            and REPLICA_ID.fullmatch(replica_id)
            and self._proves(key, replica_id, answer)
        ):
            self._names[key] = replica_id
            self._opened.pop(key, None)
            with self._lock:
                self.board.hello(replica_id, key, now)
            return True
        if word == "beat" and not rest and name is not None:
            with self._lock:
                self.board.beat(name, key, now)
            return True
        self._drop(conn, lost=False)  # `bye`, or a line that is not the protocol's
        return False

    def _proves(self, key: int, replica_id: str, answer: str) -> bool:
        """Whether a hello's answer proves the presence key for this connection's challenge (any answer,
        or none, where the service has no key)."""
        if self.key is None:
            return True
        secret = self.key() if callable(self.key) else self.key
        nonce = self._nonces.get(key)
        return (
            secret is not None and nonce is not None and hmac.compare_digest(answer, proof(secret, nonce, replica_id))
        )

    def _drop(self, conn: socket.socket, lost: bool) -> None:
        key = conn.fileno()
        self._nonces.pop(key, None)
        name = self._names.pop(key, None)
        self._buffers.pop(key, None)
        self._opened.pop(key, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()
        if name is None:
            return
        with self._lock:
            current = self.board.leave(name, key)
        if current and lost:
            self._events.append((LOST, name))


class Presence:
    """This rank's side: connect, say hello, beat with the rank's heartbeats, say bye. Best effort: a
    service that takes no presence (an older one, a firewall) leaves the heartbeat bound in force."""

    def __init__(self, lighthouse: str, replica_id: str, key: bytes | None = None, speaks: bool = False) -> None:
        self.address = address_of(lighthouse)
        self.replica_id = replica_id
        self.key = key
        self.speaks = speaks
        """Whether this rank says, once, that the service counts unproven hellos (one rank of the launch)."""
        self._sock: socket.socket | None = None
        self._wanted = False
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget_in_child)

    def _forget_in_child(self) -> None:
        """A forked child (a loader worker) closes its copy: the connection must end with this
        process, not with the last worker to outlive it. close(), never shutdown(): that would end
        the parent's connection too."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self._wanted = False

    def want(self) -> None:
        """From now on this rank counts among the group's (LiveGroup, once a group formed): the next
        beat() connects."""
        self._wanted = True

    def beat(self) -> None:
        """Called with each heartbeat: one line, or a new connection if the last one ended."""
        with self._lock:
            if not self._wanted:
                return
            if self._sock is None:
                self._connect()
                return
            try:
                self._sock.sendall(b"beat\n")
            except OSError:
                self._close()

    def move(self, lighthouse: str) -> None:
        """The service moved (placement.py): the next beat connects to its new address."""
        with self._lock:
            self.address = address_of(lighthouse)
            if self._sock is not None:
                self._close()

    def leave(self) -> None:
        with self._lock:
            self._wanted = False
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.sendall(b"bye\n")
                self._close()

    def _connect(self) -> None:
        if self._sock is not None or self.address is None or not REPLICA_ID.fullmatch(self.replica_id):
            return
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            return  # tried again at the next beat
        try:
            nonce, keyed = read_greeting(sock)
            if self.key is not None and not keyed and self.speaks:
                self.speaks = False
                warn_unkeyed(self.address)
            answer = f" {proof(self.key, nonce, self.replica_id)}" if self.key is not None and nonce else ""
            sock.sendall(f"hello {self.replica_id}{answer}\n".encode("ascii"))
        except OSError:
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


KEYED = " keyed"
CHALLENGE = re.compile(rf"challenge ([0-9a-f]{{32}})({KEYED})?", re.ASCII)


def warn_unkeyed(address: tuple[str, int]) -> None:
    """One line: the run's ranks prove its key, the service at `address` does not ask them to."""
    print(
        f"live: the presence port {address[0]}:{address[1]} takes ids at their word (a service started without "
        "--secret-file): a stranger who reaches it can make a regroup wait for ranks that do not exist, up to "
        "recovery.quorum_timeout_s; start it with --secret-file RUN_DIR/live/secret where its host shares the run dir",
        file=sys.stderr,
        flush=True,
    )


def read_challenge(sock: socket.socket) -> str | None:
    """The nonce of the service's challenge (read_greeting)."""
    return read_greeting(sock)[0]


def read_line(sock: socket.socket, missing: str) -> str:
    """One line the far side says first (within the socket's timeout, under LINE_MAX bytes), stripped;
    OSError(missing) when it closes or says more: the presence port's challenge and the front's greeting."""
    line = b""
    while not line.endswith(b"\n"):
        data = sock.recv(LINE_MAX - len(line))
        if not data or len(line) + len(data) >= LINE_MAX:
            raise OSError(missing)
        line += data
    return line.decode("ascii", "replace").strip()


def read_greeting(sock: socket.socket) -> tuple[str | None, bool]:
    """The service's `challenge <nonce>[ keyed]` line (within the socket's timeout, at most LINE_MAX
    bytes): the nonce, or None when it sends another line, and whether it counts only proven hellos."""
    found = CHALLENGE.fullmatch(read_line(sock, "no challenge from the presence port"))
    return (found.group(1), bool(found.group(2))) if found else (None, False)
