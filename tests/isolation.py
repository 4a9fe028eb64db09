"""What makes a unit test a unit test: it starts no process and opens no network connection.

tests/unit/conftest.py watches every test there, so the floor holds by itself: a unit test that starts
torchrun, forks a loader worker, forms a process group or opens a TCP socket fails naming what it
started, and belongs in tests/integration. The same watch, run over the whole fast tier, is how the
suite was sorted into its floors.

Caught where every way of starting a process in CPython ends (`_posixsubprocess.fork_exec`, the copy
subprocess keeps of it, `os.fork`, `os.posix_spawn[p]`), and at the Python socket calls plus
torch.distributed's group start-up (gloo and the TCP store open their sockets in C++). AF_UNIX sockets
are allowed: they are files, not the network.
"""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Escape = Callable[[str], None]


def _wrap(original: Callable[..., Any], what: str, on_escape: Escape) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        on_escape(what)
        return original(*args, **kwargs)

    return guarded


def _network_socket(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6)


def _wrap_socket_call(original: Callable[..., Any], what: str, on_escape: Escape) -> Callable[..., Any]:
    def guarded(sock: socket.socket, *args: Any, **kwargs: Any) -> Any:
        if _network_socket(sock):
            on_escape(what)
        return original(sock, *args, **kwargs)

    return guarded


def _targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, what it does) for every hook: one list, so forbid and watch never differ."""
    targets: list[tuple[Any, str, str]] = [
        (_posixsubprocess, "fork_exec", "started a process"),
        (subprocess, "_fork_exec", "started a process"),
        (os, "fork", "forked"),
        (os, "posix_spawn", "started a process"),
        (os, "posix_spawnp", "started a process"),
    ]
    try:
        import torch.distributed as dist
    except ImportError:  # a torch without distributed: nothing there to start
        return targets
    targets += [(dist, "init_process_group", "formed a process group"), (dist, "TCPStore", "opened a TCP store")]
    return [(owner, name, what) for owner, name, what in targets if hasattr(owner, name)]


@contextmanager
def hooks(on_escape: Escape) -> Iterator[None]:
    """Call on_escape(what) whenever the code under the hooks starts a process or opens the network."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, what in _targets():
            original = getattr(owner, name)
            saved.append((owner, name, original))
            setattr(owner, name, _wrap(original, what, on_escape))
        for name in ("connect", "connect_ex", "bind"):
            original = getattr(socket.socket, name)
            saved.append((socket.socket, name, original))
            setattr(socket.socket, name, _wrap_socket_call(original, f"opened a network socket ({name})", on_escape))
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextmanager
def watch(seen: set[str]) -> Iterator[None]:
    """Add to `seen` what the code under it started; it runs on as it would (nothing is refused, so a
    broad `except` in the code under test cannot hide an escape)."""
    with hooks(seen.add):
        yield


class Escaped(AssertionError):
    """A unit test started a process or opened the network (raised by tests/unit/conftest.py)."""
