"""This rank's own TCP store, given out behind a front, and its way to a peer's.

Why every rank hosts a TCP store of its own: the group's store lives with its rank 0, and a store
hosted by one rank dies with it. After a loss the new rank 0 (the first survivor by id) offers its own
store, already running, so no rank's loss takes the group's meeting place with it. Keys are prefixed
with the quorum's token, so a regroup never reads a previous group's keys. Each store listens on
loopback only, behind a front of its own (live/front.py: a connection proves the run's key
first), and its peers reach it through relays in their own processes (store_with_echo, peer_relay):
torch's TCPStore takes any client and bounds nothing, and a stranger filled one's memory (issue 52).
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from torchlaunch.exit_codes import BadInput
from torchlaunch.live import front
from torchlaunch.live.peers import Echo

STORE_PORT_TRIES = 20


def store_with_echo(key: bytes | None) -> tuple[Echo, dist.TCPStore, front.Front]:
    """This rank's store and echo (UDP) on one port number, so a member's store address also says where
    to probe it: a free UDP port first, then the store's front (TCP, every interface) on that number
    (tried again on another when the TCP port is taken). The store itself listens on loopback only (a
    socket of ours, given to torch): torch's TCPStore takes any client and bounds no key or value, so a
    stranger who found its port filled its memory (issue 52); the front admits only connections that
    prove `key`, which its peers make through their own relays (peer_relay)."""
    inner = socket.create_server(("127.0.0.1", 0))
    port = inner.getsockname()[1]
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=inner.fileno()
        )
    except Exception:
        inner.close()
        raise
    inner.detach()  # the listening socket is torch's now (it listens on this descriptor, not a copy)
    target = ("127.0.0.1", store.port)
    for _ in range(STORE_PORT_TRIES):
        echo = Echo()
        try:
            return echo, store, front.serve(key, ("", echo.port), lambda: target)
        except OSError:  # the TCP port of that number is taken
            echo.close()
    raise BadInput(f"live error: no port free for both this rank's store and its echo in {STORE_PORT_TRIES} tries")


def peer_relay(key: bytes | None, address: str) -> front.Relay:
    """This process's way to the store whose front is at `address` (HOST:PORT): torch's client is given
    the relay's loopback port."""
    host, _, port = address.rpartition(":")
    return front.Relay(key, (host.strip("[]"), int(port))).start()
