"""This process's sockets, and cutting the ones a broken process group left open.

Why: with 3+ ranks, a survivor can wait in a broken collective on another survivor rather than on the
lost rank, and gloo tells it nothing until that peer's connections close. A peer that leaves the
broken group shuts its own connections of that group down (recorded when the group was formed: the
sockets that appeared then), so every member still waiting gets a transport error at once, whatever
else still refers to the old group. Only the recorded sockets are touched (matched by inode, so a
descriptor number reused since is left alone); the membership service's and the stores' connections
are not among them. Linux (/proc/self/fd); elsewhere nothing is recorded or cut.
"""

from __future__ import annotations

import contextlib
import os
import socket

FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """fd -> `socket:[inode]` of every socket this process holds now (empty where /proc is missing)."""
    found: dict[int, str] = {}
    try:
        fds = os.listdir(FD_DIR)
    except OSError:
        return found
    for name in fds:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(f"{FD_DIR}/{name}")
            if target.startswith("socket:"):
                found[int(name)] = target
    return found


def cut(inodes: frozenset[str]) -> int:
    """Shut down (both ways) every connection still open whose inode is in `inodes` (listeners are left
    alone); returns how many. The descriptors stay open (their owner closes them); the peers see the
    connection end."""
    done = 0
    for fd, inode in open_sockets().items():
        if inode not in inodes:
            continue
        with contextlib.suppress(OSError):
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener: gloo aborts the process when its accept fails
                s.shutdown(socket.SHUT_RDWR)
            done += 1
    return done
