"""Relay torchrun's stderr: workers' output passes through live, torchrun's own noise is held back.

torchrun prints agent log lines and, when any worker exits non-zero, a ChildFailedError traceback and
report box. For exit 2 (bad input) and 75 (preempted) the workers' own line says everything, so the
held text is dropped; for exit 1 it is printed in full, since that is where a crash is explained.
Segments end at "\\n" or "\\r" so progress bars keep updating through the pipe.
"""

from __future__ import annotations

import os
import re
import threading
from typing import TextIO

AGENT_LOG_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
SEGMENT_END = re.compile(rb"[\r\n]")


class StderrRelay:
    """Reads a pipe in a thread, forwarding or holding each line."""

    def __init__(self, fd: int, sink: TextIO) -> None:
        self.fd, self.sink = fd, sink
        self.held: list[bytes] = []
        self._in_report = False
        self._thread = threading.Thread(target=self._pump, name="stderr-relay", daemon=True)
        self._thread.start()

    def _route(self, segment: bytes) -> None:
        if segment.startswith(b"Traceback (most recent call last)") and self.held:
            self._in_report = True  # torchrun's failure report follows its own log lines
        if self._in_report or AGENT_LOG_LINE.match(segment):
            self.held.append(segment)
            return
        out = getattr(self.sink, "buffer", None)
        if out is not None:
            out.write(segment)
        else:
            self.sink.write(segment.decode(errors="replace"))
        self.sink.flush()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk
            start = 0
            for match in SEGMENT_END.finditer(pending):
                self._route(pending[start : match.end()])
                start = match.end()
            pending = pending[start:]
        if pending:
            self._route(pending)
        os.close(self.fd)

    def finish(self, timeout: float = 30.0) -> None:
        self._thread.join(timeout)

    def release_held(self) -> None:
        for segment in self.held:
            self._route_direct(segment)
        self.held.clear()

    def _route_direct(self, segment: bytes) -> None:
        self.sink.write(segment.decode(errors="replace"))
        self.sink.flush()
