"""The membership service's front door: nothing reaches torchft's Lighthouse before it proves the run's key.

Why: torchft's Lighthouse is a Rust gRPC server that checks nothing, and torchft forms no group of half
or fewer of the ids that heartbeat it. A stranger who reached its port heartbeated forged ids and held
every quorum until its join timeout, or read the status page (issue 52). So the Lighthouse listens on
loopback only, on a port of its own, and the service's public address is this front: it says a fresh
challenge as it accepts (`front <nonce>[ keyed]`), admits a connection only after the answer (an HMAC of
the nonce under a key derived from the presence key, never the key itself on the wire), then relays its
bytes to the Lighthouse unchanged. A connection that does not prove within PROVE_WITHIN_S, or sends
anything else, is closed and never reaches the Lighthouse.

torchft's client speaks TCP only (0.2.0: no `unix:` addresses; measured), so a member reaches the front
through a relay of its own: a loopback listener, in the member's own process, that admits only
connections made by this same process (the peer socket is found in /proc/net/tcp and must be one of
this process's descriptors), proves the key on their behalf and relays. Any other process on the
member's host (its own user's too) that finds the port is closed unanswered.

The API (what a launcher that places the service needs): the service is a process,
`python -m torchlaunch.live.lighthouse --bind HOST:PORT --secret-file RUN_DIR/live/secret` (or
with the launch's key in TORCHLAUNCH_LIVE_PRESENCE_KEY), whose address http://HOST:PORT is its front;
the ranks' LighthouseMembership connects through it by itself. Inside, in-process:
  - serve(key, bind, target) -> Front: the front on `bind` (host, port) for the service at `target()`
    (host, port; asked per connection, so a restarted Lighthouse on a new port is found). `Front.port`
    is the address to give the members.
  - connect(key, address) -> Relay: the member side, for the front at `address` (http://HOST:PORT);
    `Relay.address` (http://127.0.0.1:PORT) is what torchft's LighthouseClient is given.
`key` is the presence key (live/presence.py: the launch's, or the run secret's derivation); a
service given none (loopback only, lighthouse.py refuses it elsewhere) admits every connection. Behind it,
the Lighthouse's loopback is the service's own where the host allows (live/private_net.py).
Torch-free and torchft-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from torchlaunch.live.presence import KEYED, LINE_MAX, connection_cap, read_line

PROVE_WITHIN_S = 5.0
"""A connection that has not proved the key by then is closed: a silent one holds no descriptor long."""
CONNECT_TIMEOUT_S = 5.0
CHUNK = 65_536
GREETING = re.compile(rf"front ([0-9a-f]{{32}})({KEYED})?", re.ASCII)
Key = bytes | Callable[[], bytes | None] | None


def answer(key: bytes, nonce: str) -> str:
    """The proof a connection gives for `nonce`: derived from the presence key, so the key that proves a
    presence hello is never the one that opens the front (and neither travels)."""
    front_key = hmac.new(key, b"front", hashlib.sha256).digest()
    return hmac.new(front_key, f"front\x00{nonce}".encode("ascii"), hashlib.sha256).hexdigest()


def _pipe(a: socket.socket, b: socket.socket, done: Callable[[], None]) -> None:
    """Relay bytes both ways between `a` and `b` on two daemon threads; either end closing ends both."""
    for sock in (a, b):
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    left = [2]
    lock = threading.Lock()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (a, b):  # wakes the other pump
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            a.close()
            b.close()
            done()

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(src, dst), name="torchlaunch-relay", daemon=True).start()


class Front:
    """serve()'s listener: challenges each connection on one selector thread, pipes the proven ones."""

    def __init__(self, key: Key, bind: tuple[str, int], target: Callable[[], tuple[str, int]]) -> None:
        self.key, self.target = key, target
        self.admitted = 0
        self.refused = 0
        """Connections closed unproven (for tests and the service's log)."""
        family = socket.AF_INET6 if ":" in bind[0] else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(bind)  # listening from start() on: a launcher that waits for the port waits for it
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._pending: dict[int, tuple[socket.socket, str, float, bytes]] = {}
        """fd -> (connection, nonce, accepted at, bytes read so far)."""
        self._piped: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cap = connection_cap()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="torchlaunch-front", daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> Front:
        self._listener.listen(socket.SOMAXCONN)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=2.0)
        for conn, *_ in self._pending.values():
            conn.close()
        with self._lock:
            piped = list(self._piped)
        for sock in piped:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for found, _ in self._selector.select(timeout=0.1):
                if found.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(found.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn, _, since, _ in list(self._pending.values()):
                if now - since > PROVE_WITHIN_S:
                    self._refuse(conn)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            conn, _ = self._listener.accept()
            with self._lock:
                full = len(self._pending) + len(self._piped) > self._cap
            if full:
                conn.close()
                return
            conn.setblocking(False)
            nonce = secrets.token_hex(16)
            try:
                conn.send(f"front {nonce}{KEYED if self.key is not None else ''}\n".encode("ascii"))
            except OSError:
                conn.close()
                return
            self._pending[conn.fileno()] = (conn, nonce, time.monotonic(), b"")
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        _, nonce, since, got = self._pending[fd]
        try:
            data = conn.recv(LINE_MAX - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        got += data
        if not data or (b"\n" not in got and len(got) >= LINE_MAX):
            self._refuse(conn)
            return
        if b"\n" not in got:
            self._pending[fd] = (conn, nonce, since, got)
            return
        line, _, rest = got.partition(b"\n")
        if not self._proves(nonce, line.decode("ascii", "replace")):
            self._refuse(conn)
            return
        self._forget(conn)
        try:
            backend = socket.create_connection(self.target(), timeout=CONNECT_TIMEOUT_S)
        except OSError:  # the Lighthouse is restarting: the member's client connects again
            conn.close()
            return
        try:
            backend.sendall(rest)  # the client's first bytes, sent by the member's relay after the proof
        except OSError:
            conn.close()
            backend.close()
            return
        self.admitted += 1
        with self._lock:
            self._piped.update((conn, backend))
        _pipe(conn, backend, lambda: self._unpipe(conn, backend))

    def _unpipe(self, *socks: socket.socket) -> None:
        with self._lock:
            self._piped.difference_update(socks)

    def _proves(self, nonce: str, line: str) -> bool:
        word, _, proof = line.strip().partition(" ")
        if word != "prove":
            return False
        if self.key is None:
            return True
        key = self.key() if callable(self.key) else self.key
        return key is not None and hmac.compare_digest(proof, answer(key, nonce))

    def _forget(self, conn: socket.socket) -> None:
        self._pending.pop(conn.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)

    def _refuse(self, conn: socket.socket) -> None:
        self._forget(conn)
        conn.close()
        self.refused += 1


def serve(key: Key, bind: tuple[str, int], target: Callable[[], tuple[str, int]]) -> Front:
    """The front on `bind` for the service at `target()`, serving (see the module's docstring)."""
    return Front(key, bind, target).start()


V4_MAPPED = "0000000000000000FFFF0000"
"""::ffff:0:0/96 as /proc/net/tcp6 writes its first three 32-bit words (the fourth is the IPv4 address)."""


def _kernel_hex(host: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (the raw 32-bit word in the host's byte order)."""
    return f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}"


def made_here(conn: socket.socket) -> bool:
    """Whether the peer of `conn`, an accepted loopback IPv4 connection, is a socket of this process: its
    row in /proc/net/tcp (or tcp6, for a dual-stack client's v4-mapped socket: torch's) names its inode,
    which must be one of this process's descriptors."""
    (peer_host, peer_port), (host, port) = conn.getpeername()[:2], conn.getsockname()[:2]
    rows = {
        "/proc/net/tcp": f"{_kernel_hex(peer_host)}:{peer_port:04X} {_kernel_hex(host)}:{port:04X}",
        "/proc/net/tcp6": f"{V4_MAPPED}{_kernel_hex(peer_host)}:{peer_port:04X} {V4_MAPPED}{_kernel_hex(host)}:{port:04X}",
    }
    inode = None
    try:
        for path, row in rows.items():
            with open(path, encoding="ascii") as table:
                for line in table:
                    fields = line.split()
                    if len(fields) > 9 and f"{fields[1]} {fields[2]}" == row:
                        inode = fields[9]
                        break
            if inode is not None:
                break
        if inode is None or inode == "0":
            return False
        wanted = f"socket:[{inode}]"
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == wanted:
                    return True
    except OSError:
        return False
    return False


class Relay:
    """connect()'s loopback listener for this process's torchft client: each connection it admits is one
    proven connection to the front."""

    def __init__(self, key: bytes | None, front: tuple[str, int]) -> None:
        self.key, self.front = key, front
        self.refused = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="torchlaunch-front-relay", daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Relay:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not made_here(conn):
                self.refused += 1
                conn.close()
                continue
            far = self._open()
            if far is None:
                conn.close()  # the client connects again, as to a service that restarts
                continue
            _pipe(conn, far, lambda: None)

    def _open(self) -> socket.socket | None:
        """A connection to the front that proved the key, or None."""
        try:
            far = socket.create_connection(self.front, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            return None
        try:
            found = GREETING.fullmatch(read_line(far, "no greeting from the front"))
            if found is None:
                raise OSError("not a membership service's front")
            proof = answer(self.key, found.group(1)) if self.key is not None else "-"
            far.sendall(f"prove {proof}\n".encode("ascii"))
        except OSError:
            far.close()
            return None
        return far


def connect(key: bytes | None, address: str) -> Relay:
    """The member side for the front at `address` (http://HOST:PORT), relaying (see the module's
    docstring); ValueError when `address` is not one."""
    from torchlaunch.base import rules

    found = rules.service_address(address)
    if found is None:
        raise ValueError(f"not http://HOST:PORT: {address[:80]!r}")
    return Relay(key, found).start()
