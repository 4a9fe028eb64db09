"""A loopback of the service's own: torchft's Lighthouse listens where no other process can connect.

Why: behind the front (live/front.py) the Lighthouse listens on loopback, and any process on
the service's host could still find that port by a scan and heartbeat forged ids at it (issue 52). A
network namespace of its own has a loopback of its own: a socket made before the move stays in the
host's namespace (the front's and the presence port's listeners, which the ranks reach), and every
socket made after it, by this thread or a thread it starts (the Lighthouse, the front's connections to
it), is in the new one, which no other process is in.

How: unshare(CLONE_NEWNET) where the process may (root, or CAP_SYS_ADMIN); else, in a process with no
other thread yet, a user namespace with it (the user's own id mapped to itself, so files keep their
owner). Its loopback is brought up (SIOCSIFFLAGS). Where neither is allowed (a container's seccomp
profile, user namespaces turned off) nothing changes and move() says why: the Lighthouse then listens
on the host's loopback, as its start line says. Linux only; torch-free and torchft-free.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCSIFFLAGS = 0x8914
IFF_UP_LOOPBACK_RUNNING = 0x1 | 0x8 | 0x40


def _unshare(flags: int) -> int:
    """0, or the errno of unshare(2)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return errno.ENOSYS
    if not hasattr(libc, "unshare"):
        return errno.ENOSYS
    return 0 if libc.unshare(flags) == 0 else ctypes.get_errno()


def _map_own_ids(uid: int, gid: int) -> None:
    """In a new user namespace: this user's ids mapped to themselves (files keep their owner)."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def move() -> str | None:
    """Move this thread (and the threads it starts from now on) into a network namespace of its own with
    its loopback up; None once done, else why not (nothing changed)."""
    uid, gid = os.geteuid(), os.getegid()
    failed = _unshare(CLONE_NEWNET)
    if failed and threading.active_count() == 1:  # a user namespace needs a process of one thread
        failed = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
        if not failed:
            try:
                _map_own_ids(uid, gid)
            except OSError as e:
                return f"no id map in its user namespace ({e.strerror})"  # the namespace serves nobody else
    if failed:
        return f"no network namespace of its own ({os.strerror(failed)})"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh", b"lo", IFF_UP_LOOPBACK_RUNNING))
    except OSError as e:
        return f"its loopback would not come up ({e.strerror})"
    return None
