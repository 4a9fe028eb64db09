"""Per-rank log files and their merged view.

Layout: RUN_DIR/logs/rank-N.log, appended by every attempt of rank N, one line per output line:
`2026-12-01T09:51:00.123Z <the line as the rank wrote it>` (stdout and stderr together, in the order
the tee read them). The UTC timestamp lets `python -m launch logs` interleave all ranks in time order
with `[rank N]` prefixes; `cat` still reads a file as it is.

The runner starts the tee (`start_tee`) before running a rank's program: a small child process
(this file run as a script, isolated: it imports only the standard library) that owns the read ends of two pipes now installed as the rank's
fds 1 and 2, copies each chunk to the original stdout/stderr unchanged and each line into the log.
Being a separate process is what keeps the last lines of a rank that crashes or is killed: the tee
drains its pipes to EOF whatever happens to the rank, and it ignores the stop signals the launcher
sends the rank, ending only when every writer (the rank and its data loader workers) has gone.
"""

from __future__ import annotations

import heapq
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

LOGS_DIR = "logs"
STAMP = re.compile(rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) ")
NAME = re.compile(r"^rank-(\d+)\.log$")


def folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOGS_DIR


def log_path(run_dir: str | Path, rank: int) -> Path:
    return folder(run_dir) / f"rank-{rank}.log"


def stamp(when: float | None = None) -> bytes:
    t = time.time() if when is None else when
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z").encode()


class LineStamper:
    """Turns chunks into timestamped lines; a partial line waits for its end (or `flush`)."""

    def __init__(self, out: int) -> None:
        self.out = out
        self.pending = b""

    def feed(self, chunk: bytes) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        if lines:
            prefix = stamp() + b" "
            os.write(self.out, b"".join(prefix + line + b"\n" for line in lines))

    def flush(self) -> None:
        if self.pending:
            os.write(self.out, stamp() + b" " + self.pending + b"\n")
            self.pending = b""


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # the original stream went away; the log still gets everything


def tee_main(log: str, sources: Sequence[tuple[int, int]]) -> int:
    """Copy each (pipe read end, original fd) pair to the original fd and, stamped, into `log`."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    stampers = {src: LineStamper(out) for src, _ in sources}
    selector = selectors.DefaultSelector()
    for src, dest in sources:
        selector.register(src, selectors.EVENT_READ, dest)
    while selector.get_map():
        for key, _ in selector.select():
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fd)
                stampers[key.fd].flush()
                continue
            stampers[key.fd].feed(chunk)  # the log first: whatever reached the terminal is in the log
            _write_all(key.data, chunk)
    os.close(out)
    return 0


def start_tee(path: Path) -> subprocess.Popen[bytes] | None:
    """Send this process's fds 1 and 2 through a tee into `path` (the runner calls it once per rank)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        pipes = [os.pipe(), os.pipe()]
        originals = [os.dup(1), os.dup(2)]
        fds = [pipes[0][0], originals[0], pipes[1][0], originals[1]]
        child = subprocess.Popen(
            [sys.executable, "-I", __file__, str(path), *map(str, fds)],  # stdlib only: no import path needed
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:
        return None
    for fd in (pipes[0][0], pipes[1][0], *originals):
        os.close(fd)
    os.dup2(pipes[0][1], 1)
    os.dup2(pipes[1][1], 2)
    os.close(pipes[0][1])
    os.close(pipes[1][1])
    return child


def read_lines(path: Path, rank: int, offset: int = 0) -> tuple[list[tuple[bytes, int, int, bytes]], int]:
    """(stamp, rank, line number, text) for complete lines from `offset`, and the offset after them.
    A line without a stamp (written by something else) takes the previous line's."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out = []
    last = b""
    for i, line in enumerate(data[:end].split(b"\n")[:-1]):
        m = STAMP.match(line)
        if m:
            last, text = m.group(1), line[m.end() :]
        else:
            text = line
        out.append((last, rank, i, text))
    return out, offset + end


def ranks_present(run_dir: str | Path) -> list[int]:
    try:
        names = [NAME.match(p.name) for p in folder(run_dir).iterdir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in names if m)


def merged(run_dir: str | Path, ranks: Sequence[int] | None = None) -> Iterator[str]:
    """Every line of the chosen ranks, in time order (rank order within the same millisecond)."""
    chosen = ranks_present(run_dir) if ranks is None else list(ranks)
    streams = [read_lines(log_path(run_dir, r), r)[0] for r in chosen]
    for _, rank, _, text in heapq.merge(*streams, key=lambda item: (item[0], item[1], item[2])):
        yield f"[rank {rank}] {text.decode('utf-8', 'replace')}"


if __name__ == "__main__":
    fds = [int(a) for a in sys.argv[2:]]
    sys.exit(tee_main(sys.argv[1], list(zip(fds[::2], fds[1::2], strict=True))))
