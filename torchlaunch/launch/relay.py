"""Relay torchrun's stderr: workers' output passes through live, torchrun's own noise is held back.

torchrun prints agent log lines and, when any worker exits non-zero, a ChildFailedError traceback and
report box. The workers write to the same pipe, so a traceback is held until its exception line says
whose it is: a worker's is passed on (a few milliseconds late), torchrun's ChildFailedError and the
report after it are held. The launcher drops the held text when every rank explained its own end
(exit 2, 75, or a failure its runner reported with its traceback already shown) and prints it when a
rank died without a word (killed, crashed hard), since torchrun's report then names its exit code.
Segments end at "\\n" or "\\r" so progress bars keep updating through the pipe.
"""

from __future__ import annotations

import os
import re
import threading
from typing import TextIO

AGENT_LOG_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
SEGMENT_END = re.compile(rb"[\r\n]")
TRACEBACK = b"Traceback (most recent call last)"
AGENTS_ERRORS = (b"ChildFailedError", b"elastic.multiprocessing.api.SignalException")
"""In the exception line of torchrun's own tracebacks: its report of a failed worker, and the one it ends
with after passing a stop signal on to its workers (the launcher says what the stop became in one line)."""
MAX_PENDING = 2000
"""Segments a traceback may hold back before it is passed on undecided (a runaway writer)."""


class StderrRelay:
    """Reads a pipe in a thread, forwarding or holding each line."""

    def __init__(self, fd: int, sink: TextIO) -> None:
        self.fd, self.sink = fd, sink
        self.held: list[bytes] = []
        self._in_report = False
        self._pending: list[bytes] = []
        """A traceback whose exception line has not arrived yet: a worker's or torchrun's."""
        self._thread = threading.Thread(target=self._pump, name="stderr-relay", daemon=True)
        self._thread.start()

    def _route(self, segment: bytes) -> None:
        if self._in_report or AGENT_LOG_LINE.match(segment):
            self.held.append(segment)
            return
        if segment.startswith(TRACEBACK) and not self._pending:
            self._pending.append(segment)
            return
        if self._pending:
            self._pending.append(segment)
            if is_exception_line(segment):
                block, self._pending = self._pending, []
                if any(error in segment for error in AGENTS_ERRORS):
                    self._in_report = True  # the report box follows: hold it all
                    self.held += block
                else:
                    for item in block:
                        self._emit(item)
            elif len(self._pending) > MAX_PENDING:
                self._flush_pending()
            return
        self._emit(segment)

    def _flush_pending(self) -> None:
        block, self._pending = self._pending, []
        for item in block:
            self._emit(item)

    def _emit(self, segment: bytes) -> None:
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
        self._flush_pending()  # a traceback cut short by the writer's end is still a worker's words
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


def is_exception_line(segment: bytes) -> bool:
    """The line that ends a traceback (`ValueError: ...`, `KeyboardInterrupt`): not indented, not the
    start of a chained traceback and not its connecting sentence."""
    line = segment.rstrip(b"\r\n")
    return (
        bool(line.strip())
        and not line[:1].isspace()
        and not line.startswith(
            (TRACEBACK, b"During handling of the above exception", b"The above exception was the direct cause")
        )
    )
