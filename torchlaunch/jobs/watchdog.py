"""The hang watchdog: notice that no local rank progressed for too long, dump every local rank's
Python stack, name the stalled ranks, and end the job with a retryable outcome.

Two halves. `decide` is pure: given when each rank last progressed, is the job hung? It is armed only
once a rank has reported a step (a program that never calls heartbeat is never judged), and the
default timeout is max(10 min, 50 x the median step time). `dump_stacks` has the side effects: for
each rank it either signals the rank's registered faulthandler (or runs py-spy where installed) and
copies what the rank wrote into RUN_DIR/hangs/<time>/rank-N.txt, or, for a rank that cannot act on a
signal (SIGSTOPped: state T; uninterruptible I/O: state D), writes why instead of waiting forever.
`Watchdog` polls the heartbeat files from the node's launcher and calls both; the launcher's `on_hang`
ends the ranks (`kill_ranks`: torchrun restarts the group while it may; `terminate_group` ends it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from torchlaunch import rundir
from torchlaunch.base import files, procs
from torchlaunch.jobs import progress

MIN_TIMEOUT_S = 600.0
STEP_TIMES = 50
HANGS_DIR = rundir.HANGS
DUMP_WAIT_S = 10.0
"""How long a rank that is running (not stopped) gets to write its stack after the signal."""
QUIET_S = 0.2
"""A stack file that stopped growing this long after it grew is complete (faulthandler writes it in one go)."""


def default_timeout(step_times: Sequence[float | None]) -> float:
    """max(10 min, 50 x the median step time): generous for slow steps, never shorter than 10 min."""
    known = [t for t in step_times if t is not None and t > 0]
    return max(MIN_TIMEOUT_S, STEP_TIMES * statistics.median(known)) if known else MIN_TIMEOUT_S


def resolve_timeout(option: float | None, step_times: Sequence[float | None]) -> float | None:
    """`--hang-timeout S`: None -> the default, 0 -> disabled (None), S > 0 -> S."""
    if option is None:
        return default_timeout(step_times)
    return None if option == 0 else float(option)


def parse_timeout(text: str) -> float:
    """The `--hang-timeout S` option's type for every launcher's parser: seconds >= 0 (0 disables)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds >= 0 (0 disables)")
    return value


@dataclass(frozen=True)
class Seen:
    """What the watchdog knows of one rank: when it last progressed and at which step."""

    rank: int
    last_progress: float
    step: int | None
    host: str | None = None


@dataclass(frozen=True)
class Verdict:
    hung: bool
    stalled: tuple[int, ...] = ()
    idle_s: float = 0.0
    reason: str = ""


def decide(seen: Sequence[Seen], now: float, timeout_s: float | None) -> Verdict:
    """Hung when the watchdog is armed (some rank reported a step) and no rank progressed within
    timeout_s. Every rank is then stalled; the ones furthest behind come first (the likely cause:
    the others wait for them in a collective)."""
    armed = [s for s in seen if s.step is not None]
    if timeout_s is None or not armed:
        return Verdict(False, reason="disabled" if timeout_s is None else "not armed: no rank reported a step yet")
    idle = now - max(s.last_progress for s in seen)
    if idle < timeout_s:
        return Verdict(False, idle_s=idle, reason=f"progress {idle:.0f}s ago (timeout {timeout_s:.0f}s)")
    order = sorted(seen, key=lambda s: (s.step if s.step is not None else -1, s.last_progress, s.rank))
    stalled = tuple(s.rank for s in order)
    return Verdict(True, stalled, idle, f"no rank progressed for {idle:.0f}s (timeout {timeout_s:.0f}s)")


@dataclass
class DumpResult:
    rank: int
    pid: int | None
    how: str  # "faulthandler", "py-spy", "stopped", "gone", "unavailable", "no answer"
    text: str
    path: Path | None = None


def _wait_for_growth(path: Path, before: int, deadline: float, quiet_s: float = QUIET_S) -> bytes:
    """Bytes appended to `path` after offset `before`, once they stopped growing; b'' at the deadline."""
    size, stable_since = before, None
    while time.monotonic() < deadline:
        try:
            now_size = path.stat().st_size
        except OSError:
            now_size = before
        if now_size > before and now_size == size:
            stable_since = stable_since or time.monotonic()
            if time.monotonic() - stable_since >= quiet_s:
                break
        else:
            stable_since = None
        size = now_size
        time.sleep(0.02)  # polling the file under a deadline, not synchronising on time
    try:
        return files.read_range(path, before, 1 << 20)[0]  # never blocks on a FIFO at the dump's name
    except OSError:
        return b""


def _precondition(beat: progress.RankBeat) -> DumpResult | None:
    """Why this rank cannot be asked for a stack (gone, recycled pid, stopped, D state), else None."""
    pid = beat.pid
    if pid is None or not procs.same_process(pid, beat.pid_start):
        return DumpResult(beat.rank, pid, "gone", f"rank {beat.rank}: process {pid} is gone (nothing to dump)")
    why = procs.unresponsive(pid)
    if why:
        return DumpResult(beat.rank, pid, "stopped", f"rank {beat.rank} (pid {pid}) is {why}: it cannot be dumped")
    return None


def _py_spy(beat: progress.RankBeat, wait_s: float) -> DumpResult | None:
    spy = shutil.which("py-spy")
    if not spy or beat.pid is None:
        return None
    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(beat.pid)], capture_output=True, text=True, timeout=wait_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (
        DumpResult(beat.rank, beat.pid, "py-spy", done.stdout) if done.returncode == 0 and done.stdout.strip() else None
    )


def dump_ranks(beats: Sequence[progress.RankBeat], where: Path, wait_s: float = DUMP_WAIT_S) -> list[DumpResult]:
    """Ask every rank for its stacks at once (one consistent moment, one shared deadline); never signal
    a process that is not the one recorded, nor one that did not register a handler (the signal would
    end it); a rank that cannot act on a signal is named instead of waited for."""
    results: dict[int, DumpResult] = {}
    asked: list[tuple[progress.RankBeat, Path, int]] = []
    for beat in beats:
        problem = _precondition(beat)
        if problem is not None:
            results[beat.rank] = problem
            continue
        if beat.dump_signal is None or beat.stack_file is None:
            continue
        path = where / beat.stack_file
        try:
            before = path.stat().st_size
        except OSError:
            before = 0
        try:
            os.kill(beat.pid, beat.dump_signal)  # type: ignore[arg-type]
        except OSError as e:
            results[beat.rank] = DumpResult(
                beat.rank, beat.pid, "gone", f"rank {beat.rank}: cannot signal ({e.strerror})"
            )
            continue
        asked.append((beat, path, before))
    deadline = time.monotonic() + wait_s
    for beat, path, before in asked:
        data = _wait_for_growth(path, before, deadline)
        if data:
            results[beat.rank] = DumpResult(beat.rank, beat.pid, "faulthandler", data.decode("utf-8", "replace"))
        else:
            results[beat.rank] = _precondition(beat) or DumpResult(
                beat.rank, beat.pid, "no answer", f"rank {beat.rank} (pid {beat.pid}): no stack within {wait_s:.0f}s"
            )
    for beat in beats:
        current = results.get(beat.rank)
        if current is None or current.how == "no answer":
            spied = _py_spy(beat, wait_s)
            results[beat.rank] = (
                spied
                or current
                or DumpResult(
                    beat.rank,
                    beat.pid,
                    "unavailable",
                    f"rank {beat.rank} (pid {beat.pid}): no dump handler registered and no py-spy",
                )
            )
    return [results[b.rank] for b in beats]


def dump_rank(beat: progress.RankBeat, where: Path, wait_s: float = DUMP_WAIT_S) -> DumpResult:
    """One rank's stacks (see dump_ranks)."""
    return dump_ranks([beat], where, wait_s)[0]


def hang_folder(run_dir: Path, when: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if when is None else when))
    return run_dir / HANGS_DIR / f"{stamp}-{socket.gethostname()}-{os.getpid()}"


def dump_stacks(
    run_dir: Path,
    beats: Sequence[progress.RankBeat],
    verdict: Verdict,
    *,
    wait_s: float = DUMP_WAIT_S,
    err: IO[str] | None = None,
) -> tuple[Path, list[DumpResult]]:
    """Dump every given rank into RUN_DIR/hangs/<time>-<host>/rank-N.txt and report on `err`."""
    err = err or sys.stderr
    base = hang_folder(run_dir)
    base.parent.mkdir(parents=True, exist_ok=True)
    hangs = rundir.open_folder(base.parent)  # a link planted in hangs/'s place during the run: LinkedFolder
    try:
        out = _new_folder(base, hangs)
        host = socket.gethostname()
        results: list[DumpResult] = []
        for beat, result in zip(beats, dump_ranks(beats, progress.folder(run_dir), wait_s), strict=True):
            result.path = out / f"rank-{beat.rank}.txt"
            header = f"rank {beat.rank} pid {beat.pid} host {beat.host or host} step {beat.step} ({result.how})\n"
            _write_in(hangs, result.path, header + result.text)
            results.append(result)
        return out, _report(out, hangs, host, verdict, results, err)
    finally:
        os.close(hangs)


def _new_folder(base: Path, hangs: int) -> Path:
    """RUN_DIR/hangs/<time>-<host>[-N], made relative to hangs/'s descriptor (a second hang within the
    same second gets its own folder)."""
    out, n = base, 1
    while True:
        try:
            os.mkdir(out.name, dir_fd=hangs)
            return out
        except FileExistsError:
            n += 1
            out = base.with_name(f"{base.name}-{n}")


def _write_in(hangs: int, path: Path, text: str) -> None:
    """One dump file, written relative to hangs/'s descriptor into its real (never linked) folder."""
    rundir.write_text(Path(path.parent.name) / path.name, text, durable=False, real_folder=True, dir_fd=hangs)


def _report(
    out: Path, hangs: int, host: str, verdict: Verdict, results: list[DumpResult], err: IO[str]
) -> list[DumpResult]:
    """The hang on the console and its copy, RUN_DIR/hangs/.../summary.txt."""
    stalled = ", ".join(str(r) for r in verdict.stalled)
    lines = [f"watchdog: hang on {host}: {verdict.reason}; stalled ranks {stalled} (furthest behind first)"]
    for r in results:
        lines.append(f"watchdog: rank {r.rank} (pid {r.pid}): {r.how} -> {r.path}")
        if r.how in ("faulthandler", "py-spy"):
            lines.extend(f"  [rank {r.rank}] {line}" for line in r.text.rstrip().splitlines())
        else:
            lines.append(f"  {r.text}")
    print("\n".join(lines), file=err, flush=True)
    _write_in(hangs, out / "summary.txt", "\n".join(lines) + "\n")
    return results


@dataclass
class Watchdog:
    """Polls this node's heartbeats (this host, this launch) every `poll_s` from a daemon thread; on a
    hang, dumps the stacks and calls `on_hang(verdict, folder)`, which ends the job (exit 1, state hung)."""

    run_dir: Path
    launch_id: str | None
    option_s: float | None = None
    poll_s: float = 5.0
    host: str = field(default_factory=socket.gethostname)
    clock: Callable[[], float] = time.monotonic
    _seen: dict[int, tuple[tuple[int | None, int, int], float, progress.RankBeat]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def local_beats(self) -> list[progress.RankBeat]:
        beats, _ = progress.read_all(progress.folder(self.run_dir))
        return [
            b for b in beats if b.host == self.host and (self.launch_id is None or b.launch in (None, self.launch_id))
        ]

    def observe(self) -> tuple[list[Seen], list[progress.RankBeat]]:
        """Read the heartbeats; a rank progressed when its (pid, beat) changed since the last look."""
        now = self.clock()
        beats = self.local_beats()
        for b in beats:
            key = (b.pid, b.beat, b.step or 0)
            old = self._seen.get(b.rank)
            if old is None or old[0] != key:
                self._seen[b.rank] = (key, now, b)
        seen = [Seen(rank, t, b.step, b.host) for rank, (_, t, b) in sorted(self._seen.items())]
        return seen, [b for _, _, b in self._seen.values()]

    def check(self) -> Verdict:
        seen, beats = self.observe()
        return decide(seen, self.clock(), resolve_timeout(self.option_s, [b.step_time for b in beats]))

    def start(self, on_hang: Callable[[Verdict, Path, list[progress.RankBeat]], None]) -> None:
        """Watch until stop(). After a hang it keeps watching with a clean slate: when on_hang ended the
        ranks and torchrun restarted them, the new group gets a full timeout of its own."""
        if self.option_s == 0:
            return

        def loop() -> None:
            while not self._stop.wait(self.poll_s):
                verdict = self.check()
                if verdict.hung:
                    beats = sorted((b for _, _, b in self._seen.values()), key=lambda b: b.rank)
                    try:
                        folder, _ = dump_stacks(self.run_dir, beats, verdict)
                    except OSError as e:  # full, read-only, or a link planted in hangs/'s place: still end the hang
                        folder = hang_folder(self.run_dir)
                        print(f"watchdog: stacks not written: {e.strerror or e}", file=sys.stderr, flush=True)
                    on_hang(verdict, folder, beats)
                    self._seen.clear()

        self._thread = threading.Thread(target=loop, name="torchlaunch-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 1)


def kill_ranks(beats: Sequence[progress.RankBeat]) -> list[int]:
    """What a node's launcher does on a hang under torchrun: SIGKILL the hung ranks (a rank stuck in a
    collective ignores SIGTERM), only processes that are still the recorded ones. torchrun sees its
    workers fail and restarts the group while restarts remain, else exits 1 (retryable)."""
    killed = []
    for b in beats:
        if b.pid is not None and procs.same_process(b.pid, b.pid_start):
            try:
                os.kill(b.pid, signal.SIGKILL)
                killed.append(b.pid)
            except OSError:
                pass
    return killed


def terminate_group(child: subprocess.Popen, grace_s: float = 30.0) -> None:
    """What a launcher's on_hang does with its torchrun child: SIGTERM, then SIGKILL after grace_s.
    A rank stuck in a collective ignores the first; the exit code stays 1 (retryable)."""
    try:
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
    except ProcessLookupError:
        pass
