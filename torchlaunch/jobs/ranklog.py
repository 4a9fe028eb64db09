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
A rank that ends waits for its tee to have copied what it wrote (`drained`, bounded): without it the
launcher could report the rank's end, and a container or a Slurm step end, before the rank's last
lines reached the console (its traceback missing from `kubectl logs`), while the tee still started.

What reaches the console (the launcher's terminal, a Slurm task's output file, a pod's log) is the
launcher's `Console` choice: every rank's output unchanged (the default, as under torchrun), each line
prefixed `[rank N] ` (`--rank-prefix`), only some ranks (`--console-ranks 0,3` / `none`). The log
files always get every line of every rank.
"""

from __future__ import annotations

import errno
import heapq
import os
import re
import select
import selectors
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

contract: ModuleType | None = None
if __name__ != "__main__":  # run as the tee (python -I this file) it imports the standard library only
    from torchlaunch import contract

TEE_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STAMP = re.compile(rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) ")
NAME = re.compile(r"^rank-(\d+)\.log$", re.ASCII)
READ_BYTES = 4 << 20
"""The most `logs` reads of one log at a time: the tail of a 2 GB log, never all of it."""


PREFIX_ENV = "" if contract is None else contract.RANK_PREFIX
CONSOLE_RANKS_ENV = "" if contract is None else contract.CONSOLE_RANKS


@dataclass(frozen=True)
class Console:
    """Which ranks' output reaches the console, and whether each line names its rank."""

    prefix: bool = False
    ranks: frozenset[int] | None = None
    """None: every rank."""

    def env(self) -> dict[str, str]:
        """What the launcher puts in every rank's environment (nothing for the default)."""
        out = {PREFIX_ENV: "1"} if self.prefix else {}
        if self.ranks is not None:
            out[CONSOLE_RANKS_ENV] = ",".join(map(str, sorted(self.ranks)))
        return out

    def args(self) -> list[str]:
        """The launcher options that choose this (a pod's inner launcher gets them)."""
        out = ["--rank-prefix"] if self.prefix else []
        if self.ranks is not None:
            out += ["--console-ranks", ",".join(map(str, sorted(self.ranks))) or "none"]
        return out

    def shows(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def label(self, rank: int) -> bytes:
        return f"[rank {rank}] ".encode() if self.prefix else b""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Console:
        """The rank side; a value the launcher did not write is read as the default (show everything)."""
        env = dict(os.environ) if env is None else env
        raw = env.get(CONSOLE_RANKS_ENV)
        try:
            ranks = None if raw is None else parse_ranks(raw or "none")
        except ValueError:
            ranks = None
        return cls(prefix=env.get(PREFIX_ENV) == "1", ranks=ranks)


RANK_RANGE = re.compile(r"([0-9]{1,7})(?:-([0-9]{1,7}))?", re.ASCII)


def parse_ranks(text: str) -> frozenset[int]:
    """`0,3`, `0-3,8` or `none` -> the ranks; ValueError naming the bad part (the launcher's argparse
    turns it into one line, exit 2)."""
    text = text.strip()
    if text.lower() == "none":
        return frozenset()
    ranks: set[int] = set()
    for part in text.split(","):
        match = RANK_RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{part.strip()!r} is not a rank or a range (e.g. 0,2-3 or none)")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) else low
        if high < low or high - low > 65536:
            raise ValueError(f"{part.strip()!r}: an empty or too large range (e.g. 0-3)")
        ranks.update(range(low, high + 1))
    return frozenset(ranks)


class ConsoleWriter:
    """Copies a rank's chunks to its console fd: unchanged, or with `label` at the start of every
    line (after a newline or a carriage return, so a progress bar redrawn in place keeps it), streaming: a partial line
    is written at once, not held back until its end."""

    def __init__(self, fd: int, label: bytes) -> None:
        self.fd = fd
        self.label = label
        self.at_line_start = True

    def write(self, chunk: bytes) -> None:
        if not self.label:
            _write_all(self.fd, chunk)
            return
        out = bytearray()
        for piece in re.split(rb"(?<=[\r\n])", chunk):
            if not piece:
                continue
            if self.at_line_start:
                out += self.label
            out += piece
            self.at_line_start = piece.endswith((b"\n", b"\r"))
        _write_all(self.fd, bytes(out))


def folder(run_dir: str | Path) -> Path:
    from torchlaunch import rundir  # here, not at the top: this file also runs as the tee, stdlib only (-I)

    return rundir.logs(run_dir)


def log_path(run_dir: str | Path, rank: int) -> Path:
    return folder(run_dir) / f"rank-{rank}.log"


def stamp(when: float | None = None) -> bytes:
    t = time.time() if when is None else when
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z").encode()


class LogSink:
    """The log file as the tee writes it: a write the storage refuses (a full disk, a quota, an I/O
    error) costs the log those lines, never the tee. A tee that died of it took the rank's console with
    it, and then the rank (its next line met a closed pipe): a full disk ended in the tee's traceback
    and exit 1, the rank's own one-line storage error never shown. A gap is said once on the console
    (`note`, the tee's stderr) and marked in the log where writing works again."""

    def __init__(self, fd: int, path: str, note: int = 2) -> None:
        self.fd, self.path, self.note = fd, path, note
        self.gap: str | None = None
        """What the storage said when the current gap began; None while every line is written."""
        self.at_line_start = True

    def write(self, data: bytes) -> None:
        if self.gap is not None:
            cut = b"" if self.at_line_start else b"\n"
            data = cut + stamp() + f" launch: lines missing above ({self.gap})\n".encode() + data
        try:
            while data:
                written = os.write(self.fd, data)
                self.at_line_start = data[written - 1 : written] == b"\n" if written else self.at_line_start
                data = data[written:]
        except OSError as e:
            if self.gap is None:
                self.gap = e.strerror or type(e).__name__
                _write_all(self.note, f"launch: {self.path}: {self.gap}: lines go to the console only\n".encode())
            return
        self.gap = None


class LineStamper:
    """Turns chunks into timestamped lines; a partial line waits for its end (or `flush`)."""

    def __init__(self, out: LogSink) -> None:
        self.out = out
        self.pending = b""

    def feed(self, chunk: bytes) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        if lines:
            prefix = stamp() + b" "
            self.out.write(b"".join(prefix + line + b"\n" for line in lines))

    def flush(self) -> None:
        if self.pending:
            self.out.write(stamp() + b" " + self.pending + b"\n")
            self.pending = b""


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # the original stream went away; the log still gets everything


def open_log(log: str) -> int:
    """An append fd on the rank log `log`, a regular file: never following a symlink at its name (a
    root rank must not append to what it points at), never blocking on a FIFO (O_NONBLOCK: ENXIO
    without a reader). Anything but a regular file there is removed and the log made anew; where that
    fails, /dev/null (the console still gets every line). Stdlib only: this runs as its own script."""
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    why = "is not a regular file and cannot be replaced"
    for _ in range(2):
        try:
            fd = os.open(log, flags, 0o644)
        except OSError as e:
            fd = None
            if e.errno not in (errno.ELOOP, errno.ENXIO):  # not a link or a FIFO: a log there is kept
                why = f"cannot be opened ({e.strerror})"
                break
        if fd is not None:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
        try:
            os.unlink(log)
            flags |= os.O_EXCL
        except OSError:
            break
    print(f"launch: {log} {why}: not written", file=sys.stderr, flush=True)
    return os.open(os.devnull, os.O_WRONLY)


DRAINED = b"d"
"""The tee's answer to a drain request: everything written before the request has been copied."""


def tee_main(
    log: str,
    sources: Sequence[tuple[int, int]],
    label: bytes = b"",
    show: bool = True,
    control: tuple[int, int] | None = None,
) -> int:
    """Copy each (pipe read end, original fd) pair, stamped, into `log` and, when `show`, to the
    original fd (each line starting with `label`). `control` (request read end, answer write end):
    a byte on the first makes the tee copy everything readable now, then answer DRAINED."""
    # The rank decides a stop; its log must outlive it to record it. Spelled here because the tee
    # imports the standard library only: the set is torchlaunch.stop_signals' (a test compares them).
    for sig in TEE_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    try:
        out = open_log(log)
    except OSError as e:  # its folder cannot be made (a full disk): the console still gets every line
        print(f"launch: {log}: {e.strerror}: not written", file=sys.stderr, flush=True)
        out = os.open(os.devnull, os.O_WRONLY)
    sink = LogSink(out, log)
    stampers = {src: LineStamper(sink) for src, _ in sources}
    writers = {src: ConsoleWriter(dest, label) if show else None for src, dest in sources}
    open_sources = set(writers)
    selector = selectors.DefaultSelector()
    for src in writers:
        os.set_blocking(src, False)  # a drain reads until the pipe is empty, never waits on it
        selector.register(src, selectors.EVENT_READ)
    if control is not None:
        selector.register(control[0], selectors.EVENT_READ)

    def copy(src: int) -> bool:
        """One chunk from `src` into the log and the console; False when nothing was there to read."""
        try:
            chunk = os.read(src, 65536)
        except BlockingIOError:
            return False
        if not chunk:  # every writer has gone
            selector.unregister(src)
            open_sources.discard(src)
            stampers[src].flush()
            return False
        stampers[src].feed(chunk)  # the log first: whatever reached the terminal is in the log
        writer = writers[src]
        if writer is not None:
            writer.write(chunk)
        return True

    while open_sources:
        for key, _ in selector.select():
            if key.fd in writers:
                if key.fd in open_sources:
                    copy(key.fd)
                continue
            assert control is not None
            if not os.read(control[0], 4096):  # the rank and its forked children have all gone
                selector.unregister(control[0])
                continue
            for src in list(open_sources):
                while src in open_sources and copy(src):
                    pass
            try:
                os.write(control[1], DRAINED)
            except OSError:  # the rank stopped waiting: nothing to tell
                pass
    os.close(out)
    return 0


def start_tee(path: Path, rank: int = 0, console: Console | None = None) -> subprocess.Popen[bytes] | None:
    """Send this process's fds 1 and 2 through a tee into `path` and, as `console` says, to the
    console (the runner calls it once per rank)."""
    console = console or Console()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        pipes = [os.pipe(), os.pipe()]
        request, answer = os.pipe(), os.pipe()
        originals = [os.dup(1), os.dup(2)]
        fds = [pipes[0][0], originals[0], pipes[1][0], originals[1]]
        child = subprocess.Popen(
            [
                sys.executable,
                "-I",  # stdlib only: no import path needed
                __file__,
                str(path),
                console.label(rank).decode() or "-",
                "1" if console.shows(rank) else "0",
                str(request[0]),
                str(answer[1]),
                *map(str, fds),
            ],
            pass_fds=[*fds, request[0], answer[1]],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:
        return None
    for fd in (pipes[0][0], pipes[1][0], *originals, request[0], answer[1]):
        os.close(fd)
    os.dup2(pipes[0][1], 1)
    os.dup2(pipes[1][1], 2)
    os.close(pipes[0][1])
    os.close(pipes[1][1])
    global _drain_channel
    _drain_channel = (request[1], answer[0], os.getpid())
    return child


_drain_channel: tuple[int, int, int] | None = None
"""(request write end, answer read end, the pid that started the tee) in a rank with a tee."""

DRAIN_WAIT_S = 5.0
"""How long a rank that ends waits for its tee: milliseconds when it runs, the bound when it is stuck
(a console nobody reads)."""


def drained(timeout_s: float = DRAIN_WAIT_S) -> bool:
    """Wait until this rank's tee has copied everything the rank wrote so far to the log and the
    console; False without a tee (or in a forked child), when the tee is gone, or past `timeout_s`."""
    if _drain_channel is None or _drain_channel[2] != os.getpid():
        return False
    request, answer, _ = _drain_channel
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the program: nothing of it left to copy
            pass
    try:
        os.write(request, b"?")
        ready, _, _ = select.select([answer], [], [], timeout_s)
        return bool(ready) and os.read(answer, 1) == DRAINED
    except OSError:
        return False


def read_lines(
    path: Path, rank: int, offset: int | None = None
) -> tuple[list[tuple[bytes, int, int, bytes]], int | None]:
    """(stamp, rank, line number, text) for complete lines from `offset` (None: the last READ_BYTES of
    the log, from a line start), and the offset after them. At most READ_BYTES per call, through
    files.read_range: a FIFO or a symlink under a log's name is not read, a 2 GB log not read whole.
    A line without a stamp (written by something else) takes the previous line's."""
    from torchlaunch.base import files  # here: the tee runs this module as a stdlib-only script

    try:
        data, start = files.read_range(path, -READ_BYTES if offset is None else offset, READ_BYTES)
    except OSError:
        return [], offset
    if offset is None and start > 0:  # the tail of a long log: from its first whole line
        cut = data.find(b"\n") + 1
        data, start = data[cut:], start + cut
    end = data.rfind(b"\n") + 1
    if end == 0 and len(data) >= READ_BYTES:  # one line longer than a read: pass it in pieces
        end = len(data)
    out = []
    last = b""
    for i, line in enumerate(data[:end].split(b"\n")[:-1]):
        m = STAMP.match(line)
        if m:
            last, text = m.group(1), line[m.end() :]
        else:
            text = line
        out.append((last, rank, i, text))
    return out, start + end


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
    log_file, label_arg, show_arg, request_fd, answer_fd, *fd_args = sys.argv[1:]
    fds = [int(a) for a in fd_args]
    pairs = list(zip(fds[::2], fds[1::2], strict=True))
    label_bytes = b"" if label_arg == "-" else label_arg.encode()
    sys.exit(tee_main(log_file, pairs, label_bytes, show_arg == "1", (int(request_fd), int(answer_fd))))
