"""Minimal inotify through ctypes: wake up the moment a file appears or grows.

Polling a directory would miss a checkpoint write that lasts milliseconds; inotify reports it.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
from dataclasses import dataclass

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_HEADER = struct.Struct("iIII")

# The process's own symbols, libc's among them: find_library('c') would start ldconfig.
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Event:
    directory: str
    name: str
    mask: int

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    @property
    def is_dir(self) -> bool:
        return bool(self.mask & IN_ISDIR)


class Watch:
    """Watches directories for created, moved-in and modified entries."""

    MASK = IN_CREATE | IN_MOVED_TO | IN_MODIFY | IN_CLOSE_WRITE

    def __init__(self) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._fd = fd
        self._dirs: dict[int, str] = {}

    def add(self, directory: str) -> None:
        wd = _libc.inotify_add_watch(self._fd, os.fsencode(directory), self.MASK)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch({directory}) failed")
        self._dirs[wd] = directory

    def read(self, timeout_s: float) -> list[Event]:
        """Events that arrive within `timeout_s` (empty list on timeout)."""
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout_s))
        if not ready:
            return []
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return []
        events, offset = [], 0
        while offset < len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            offset += _HEADER.size
            name = data[offset : offset + length].rstrip(b"\0").decode(errors="replace")
            offset += length
            if wd in self._dirs:
                events.append(Event(self._dirs[wd], name, mask))
        return events

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
