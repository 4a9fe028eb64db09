"""Per-rank progress: a tiny heartbeat file per rank, and the stack-dump hook the watchdog pulls.

    from torchlaunch.jobs.progress import heartbeat
    for step in range(start, total):
        ...                        # your training step
        heartbeat(step + 1, total=total, epoch=epoch)

The built-in trainer and the API's per-step call do this already; a loop that uses neither calls
`heartbeat(step)` itself. Without a launcher (TORCHLAUNCH_PROGRESS_DIR unset) it does nothing.

Cost: the step is a Python int the caller already has (never a tensor: no host sync). A call reads the
monotonic clock; at most every `interval_s` seconds it replaces RUN_DIR/progress/rank-N.json (a few
hundred bytes, temp file + rename, no fsync): microseconds per step, far below 1% of any real step.
The file carries the step, the time, the median step time (which sets the watchdog's default hang
timeout), images/s, and how the launcher can ask this rank for a Python stack dump: the signal that
`register_stack_dump` gave to faulthandler and the file it writes into.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from torchlaunch import contract, rundir
from torchlaunch.base import procs
from torchlaunch.base.files import as_float, as_int, as_str, read_json
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import ranklog

PROGRESS_DIR_ENV = contract.PROGRESS_DIR
LAUNCH_ENV = contract.ATTEMPT_ID
PROGRESS_DIR = rundir.PROGRESS
DEFAULT_INTERVAL_S = 5.0
DUMP_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else None
"""The stack-dump request. Not SIGUSR1/SIGUSR2: the launchers already mean "preempted" by those.
Its default action ends a process, so the watchdog sends it only to a rank whose heartbeat says that
it registered the dump handler."""
MAX_RANKS = 1 << 16


def folder(run_dir: str | Path) -> Path:
    return rundir.progress(run_dir)


def beat_path(where: Path, rank: int) -> Path:
    return where / f"rank-{rank}.json"


def stack_path(where: Path, rank: int) -> Path:
    return where / f"rank-{rank}.stack"


class Heartbeat:
    """One rank's writer. `beat(step)` is cheap; the file is replaced at most every `interval_s`."""

    def __init__(
        self,
        where: Path,
        rank: int,
        *,
        local_rank: int = 0,
        world_size: int | None = None,
        launch_id: str | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Any = time.monotonic,
    ) -> None:
        self.where = where
        self.rank = rank
        self.local_rank = local_rank
        self.launch_id = launch_id
        self.interval_s = interval_s
        self._clock = clock
        self._pid = os.getpid()
        self._base: dict[str, Any] = {
            "rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "launch": launch_id,
            "host": socket.gethostname(),
            "pid": self._pid,
            "pid_start": procs.start_ticks(self._pid),
        }
        self._next_write = float("-inf")
        self._count = 0
        self._last: tuple[float, int] | None = None
        self._step_times: deque[float] = deque(maxlen=32)
        self._fields: dict[str, Any] = {}
        self._pending: tuple[int, int | None, int | None, int | None] | None = None
        self.dump: dict[str, Any] = {}

    def beat(
        self,
        step: int,
        *,
        total: int | None = None,
        epoch: int | None = None,
        samples_per_step: int | None = None,
        force: bool = False,
    ) -> None:
        now = self._clock()
        if now < self._next_write and not force:
            self._pending = (step, total, epoch, samples_per_step)  # written by flush() if no later beat is
            return
        self._pending = None
        self._next_write = now + self.interval_s
        step = int(step)
        if self._last is not None and step > self._last[1]:
            self._step_times.append((now - self._last[0]) / (step - self._last[1]))
        self._last = (now, step)
        self._count += 1
        step_time = statistics.median(self._step_times) if self._step_times else None
        images = samples_per_step / step_time if samples_per_step and step_time else None
        self._fields = {"step": step, "total": total, "epoch": epoch, "step_time": step_time, "images_per_s": images}
        self._write()

    def flush(self) -> None:
        """Write the last step reported, if the interval held it back: at the end of a run the file
        would otherwise show a step up to `interval_s` old (`status` of a finished run: a stale step)."""
        if self._pending is not None and self._pid == os.getpid():
            step, total, epoch, samples_per_step = self._pending
            self.beat(step, total=total, epoch=epoch, samples_per_step=samples_per_step, force=True)

    def _write(self) -> None:
        payload = {**self._base, **self._fields, **self.dump, "beat": self._count, "time": time.time()}
        try:
            rundir.write_json(beat_path(self.where, self.rank), payload, durable=False, real_folder=True)
        except OSError:
            pass  # progress is advisory: a full or vanished disk must not stop training


_writer: Heartbeat | None = None
_stack_file: IO[bytes] | None = None


def _current() -> Heartbeat | None:
    global _writer
    where = contract.get(PROGRESS_DIR_ENV)
    if not where:
        return None
    if _writer is not None and _writer._pid != os.getpid():
        return None  # a forked child (a data loader worker) is not the rank: it must not overwrite its file
    if _writer is None:
        _writer = Heartbeat(
            Path(where),
            contract.rank(),
            local_rank=contract.local_rank(),
            world_size=started_world(),
            launch_id=contract.get(LAUNCH_ENV),
        )
    return _writer


def started_world() -> int | None:
    """The world this rank starts in: its first live group's where a `--nnodes MIN:MAX` launch formed it
    of the nodes that came in time (contract.LIVE_FIRST_GROUP), else WORLD_SIZE; None without a launcher.
    A malformed value is the worker's to refuse, not the heartbeat's."""
    try:
        first = contract.live_first_group()
    except BadInput:
        first = None
    return first[1] if first is not None else contract.world_size() or None


def heartbeat(
    step: int, *, total: int | None = None, epoch: int | None = None, samples_per_step: int | None = None
) -> None:
    """Report that this rank reached `step` (a Python int). Cheap; a no-op outside a launcher."""
    writer = _current()
    if writer is not None:
        writer.beat(step, total=total, epoch=epoch, samples_per_step=samples_per_step)


def flush() -> None:
    """Write this rank's last reported step now (the rank is ending); a no-op outside a launcher."""
    if _writer is not None:
        _writer.flush()


def register_stack_dump() -> Path | None:
    """Let the launcher ask this rank for its Python stacks (faulthandler on DUMP_SIGNAL, all threads,
    appended to RUN_DIR/progress/rank-N.stack) and announce it in a first heartbeat. The runner calls
    this once per rank; a no-op outside a launcher or where the signal does not exist."""
    global _stack_file
    writer = _current()
    if writer is None or DUMP_SIGNAL is None:
        return None
    path = stack_path(writer.where, writer.rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _stack_file = os.fdopen(ranklog.open_log(str(path)), "ab")  # held until the process ends
        faulthandler.register(DUMP_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        return None
    writer.dump = {"dump_signal": int(DUMP_SIGNAL), "stack_file": path.name}
    writer._write()
    return path


@dataclass(frozen=True)
class RankBeat:
    """One rank's last heartbeat as read back (every field checked; unknown values are None)."""

    rank: int
    local_rank: int | None
    launch: str | None
    host: str | None
    pid: int | None
    pid_start: int | None
    beat: int
    time: float | None
    step: int | None
    total: int | None
    epoch: int | None
    step_time: float | None
    images_per_s: float | None
    dump_signal: int | None
    stack_file: str | None
    world_size: int | None = None
    """WORLD_SIZE of the attempt that wrote the beat (status shows it: a run may continue on fewer)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankBeat | None:
        rank = as_int(data.get("rank"), 0, MAX_RANKS)
        if rank is None:
            return None
        stack = as_str(data.get("stack_file"), 64)
        return cls(
            rank=rank,
            local_rank=as_int(data.get("local_rank"), 0, MAX_RANKS),
            world_size=as_int(data.get("world_size"), 1, MAX_RANKS),
            launch=as_str(data.get("launch"), 64),
            host=as_str(data.get("host"), 256),
            pid=as_int(data.get("pid"), 2, 1 << 31),
            pid_start=as_int(data.get("pid_start"), 0),
            beat=as_int(data.get("beat"), 0) or 0,
            time=as_float(data.get("time"), 0),
            step=as_int(data.get("step"), 0),
            total=as_int(data.get("total"), 0),
            epoch=as_int(data.get("epoch"), 0),
            step_time=as_float(data.get("step_time"), 0),
            images_per_s=as_float(data.get("images_per_s"), 0),
            dump_signal=as_int(data.get("dump_signal"), 1, 128),
            stack_file=stack if stack == f"rank-{rank}.stack" else None,  # never a path of the file's choosing
        )


def read_all(where: Path) -> tuple[list[RankBeat], list[str]]:
    """Every rank's heartbeat (by rank) and one problem line per unusable file."""
    beats: list[RankBeat] = []
    problems: list[str] = []
    try:
        paths = sorted(p for p in where.glob("rank-*.json") if p.is_file())
    except OSError:
        paths = []
    for path in paths[:MAX_RANKS]:
        data, why = read_json(path)
        beat = RankBeat.from_json(data) if data is not None else None
        if beat is None or path.name != f"rank-{beat.rank}.json":
            problems.append(f"{path.name}: {why or 'not a heartbeat of this rank'} (ignored)")
        else:
            beats.append(beat)
    return sorted(beats, key=lambda b: b.rank), problems
