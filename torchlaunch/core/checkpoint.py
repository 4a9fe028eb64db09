"""Durable checkpoints: atomic commit, checksum, retention, discovery and safe loading.

Layout: RUN_DIR/checkpoints/step-000001234/{state.pt, COMMITTED.json}.
Commit protocol (rank 0 only):
  1. serialise the state, checksum it (xxh3-128), write state.pt into a hidden temp folder, fsync;
  2. rename the temp folder to step-NNNNNNNNN (atomic) and fsync the parent folder;
  3. write COMMITTED.json (checksum, size, step, metrics) to a temp name, fsync, rename; fsync folder.
A checkpoint is valid only when its marker exists and the state file's size and checksum match it, so a
crash at any byte leaves at most an invalid folder that discovery skips and the next start removes;
the previous checkpoint is never touched before a newer one is committed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from torchlaunch.exit_codes import ConfigError

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MARKER_FILE = "COMMITTED.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"


class CheckpointError(Exception):
    """A checkpoint could not be written; the message says why and what survived."""


class InvalidCheckpoint(Exception):
    """A checkpoint failed verification or safe loading; the message says why."""


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def parse_step(name: str) -> int | None:
    """Step number of a checkpoint folder name, as an integer (never compared as text)."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


CHECKSUM = "xxh3_128"
"""Content checksum of state files: detects truncation and bit flips (not an attacker: the safe
loader handles that) at ~20 GB/s, so verifying costs a few percent of a load, unlike sha256."""


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise InvalidCheckpoint(f"unknown checksum algorithm {algorithm!r}")


def file_checksum(path: Path, algorithm: str = CHECKSUM) -> str:
    """ "algorithm:hex" of a file, read in 8 MiB blocks."""
    h = _hasher(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 23), b""):
            h.update(block)
    return f"{algorithm}:{h.hexdigest()}"


def expected_checksum(marker: dict[str, Any]) -> str:
    """The marker's checksum as "algorithm:hex" (markers may carry a bare "sha256" field)."""
    if "checksum" in marker:
        return str(marker["checksum"])
    return f"sha256:{marker['sha256']}"


class _HashingFile(io.RawIOBase):
    """A write-only file that checksums every byte on its way to disk (no second pass)."""

    def __init__(self, fh: io.BufferedWriter) -> None:
        self.fh, self.hash, self.size = fh, _hasher(CHECKSUM), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        return self.fh.write(view)

    def flush(self) -> None:
        self.fh.flush()

    @property
    def checksum(self) -> str:
        return f"{CHECKSUM}:{self.hash.hexdigest()}"


def _write_hashed(path: Path, state: dict[str, Any]) -> tuple[int, str]:
    """torch.save straight to disk through a checksumming writer, then fsync."""
    with open(path, "wb") as raw:
        hashing = _HashingFile(raw)
        torch.save(state, hashing)
        raw.flush()
        os.fsync(raw.fileno())
    return hashing.size, hashing.checksum


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass(frozen=True)
class CommitInfo:
    path: Path
    step: int
    checksum: str
    size: int
    seconds: float


def write_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    before_commit: Callable[[Path], None] | None = None,
    replace: bool = False,
) -> CommitInfo:
    """Commit `state` as step `step` under `root`; raise CheckpointError and keep the previous on failure.

    A committed checkpoint of the same step is kept as it is unless `replace` (a newer state of the same
    step, e.g. after validation): then the new one is committed in full before the old one moves aside.
    `before_commit` is a test hook called with the temp folder after the state is written.
    """
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if not replace and verify(final) is None:
        marker = read_marker(final)
        return CommitInfo(final, step, expected_checksum(marker), marker["bytes"], 0.0)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        size, digest = _write_hashed(tmp / STATE_FILE, state)
        if before_commit is not None:
            before_commit(tmp)
        _fault_injection_stall(tmp, step)
        marker = dict(
            meta, step=step, checksum=digest, bytes=size, format_version=FORMAT_VERSION, committed_at=time.time()
        )
        if final.exists() and (final / MARKER_FILE).exists():
            # Commit inside the temp folder first, then swap: a crash between the two renames leaves
            # the old folder aside, and clean_stale() puts it back at the next start (no step is lost).
            _write_json_atomic(tmp / MARKER_FILE, marker)
            aside = root / f"{REPLACED_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(tmp, final)
            _fsync_dir(root)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            if final.exists():  # an uncommitted leftover of a crashed save of this same step
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
            _write_json_atomic(final / MARKER_FILE, marker)
    except (OSError, RuntimeError) as e:  # torch.save wraps a failed write in a RuntimeError
        os_error = _root_os_error(e)
        if os_error is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        if final.exists() and not (final / MARKER_FILE).exists():
            shutil.rmtree(final, ignore_errors=True)
        previous = newest_committed(root)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        if os_error.errno == errno.ENOSPC:
            raise CheckpointError(
                f"checkpoint error: no space left on device writing {final} "
                f"(free space or point run_dir at a larger volume); {kept}"
            ) from None
        raise CheckpointError(f"checkpoint error: writing {final} failed: {os_error} ({kept})") from None
    return CommitInfo(final, step, marker["checksum"], marker["bytes"], time.perf_counter() - start)


def _root_os_error(e: BaseException) -> OSError | None:
    """The OSError behind an exception chain (torch's zip writer reports ENOSPC as a RuntimeError)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _fault_injection_stall(tmp: Path, step: int) -> None:
    """Fault-injection aid for crash tests: with TORCHLAUNCH_FAULT_SAVE_STALL_S set, saves of steps from
    TORCHLAUNCH_FAULT_SAVE_STALL_FROM_STEP (default 0) announce that a write is provably in progress (a
    STALLING file in the temp folder) and hold it open that long."""
    stall = os.environ.get("TORCHLAUNCH_FAULT_SAVE_STALL_S")
    if stall and step >= int(os.environ.get("TORCHLAUNCH_FAULT_SAVE_STALL_FROM_STEP", "0")):
        marker = tmp / "STALLING"
        marker.write_text(str(os.getpid()))
        time.sleep(float(stall))
        marker.unlink()


def read_marker(path: Path) -> dict[str, Any]:
    return json.loads((path / MARKER_FILE).read_text())


def _marker_problem(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(reason, marker): the reason is None when the marker is present and well-formed."""
    if not (path / MARKER_FILE).is_file():
        return "no commit marker (the save never finished)", {}
    try:
        marker = read_marker(path)
        expected_checksum(marker), int(marker["bytes"])
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable commit marker ({e})", {}
    if not (path / STATE_FILE).is_file():
        return "state file missing", marker
    size = (path / STATE_FILE).stat().st_size
    if size != int(marker["bytes"]):
        return f"size {size} bytes, expected {marker['bytes']} (truncated?)", marker
    return None, marker


CHECKSUM_MISMATCH = "checksum mismatch (corrupted bytes)"


def verify(path: Path) -> str | None:
    """None when the checkpoint folder is committed and its bytes match; else the reason."""
    reason, marker = _marker_problem(path)
    if reason is not None:
        return reason
    expected = expected_checksum(marker)
    actual = file_checksum(path / STATE_FILE, expected.partition(":")[0])
    return None if actual == expected else CHECKSUM_MISMATCH


def _in_thread(fn: Callable[..., str], *args: Any) -> Callable[[], str]:
    """Start fn(*args) in a thread; the returned callable joins it and returns (or raises) its outcome."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            outcome["error"] = e

    thread = threading.Thread(target=run, name="checkpoint-verify", daemon=True)
    thread.start()

    def result() -> str:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return result


def load_state(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify and load with weights_only=True: a file that needs arbitrary code is refused.

    The checksum is computed in a thread while torch.load reads the same file (xxhash and hashlib
    release the GIL while hashing), so verifying adds little to a load when a core is free. The state
    is returned only when the checksum matches; on a mismatch the loaded object (or the loader's error)
    is discarded and the mismatch is reported, as when the file was verified first. Parsing the bad
    bytes meanwhile is safe: weights_only=True is what refuses crafted files in the first place."""
    reason, marker = _marker_problem(path)
    if reason is not None:
        raise InvalidCheckpoint(reason)
    expected = expected_checksum(marker)
    algorithm = expected.partition(":")[0]
    _hasher(algorithm)  # an unknown algorithm fails before any work
    checksum = _in_thread(file_checksum, path / STATE_FILE, algorithm)
    try:
        state = _safe_load(path / STATE_FILE, map_location)
    except BaseException:
        if checksum() != expected:
            raise InvalidCheckpoint(CHECKSUM_MISMATCH) from None
        raise
    if checksum() != expected:
        raise InvalidCheckpoint(CHECKSUM_MISMATCH)
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        version = state.get("format_version") if isinstance(state, dict) else None
        raise InvalidCheckpoint(f"format version {version!r}, this build reads {FORMAT_VERSION}")
    return state


def _safe_load(file: Path, map_location: str | torch.device) -> Any:
    """torch.load(weights_only=True), its refusals and read errors as InvalidCheckpoint."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "Unsupported" in ln or "WeightsUnpickler" in ln]
        first = lines[0].split(". Please")[0] if lines else (str(e).strip().splitlines() or ["unsupported content"])[0]
        raise InvalidCheckpoint(f"refused by the safe loader (weights_only=True), nothing executed: {first}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise InvalidCheckpoint(f"cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def candidates(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint folders under root, newest step first."""
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir() and (step := parse_step(p.name)) is not None]
    return sorted(found, key=lambda item: item[0], reverse=True)


def newest_committed(root: Path) -> Path | None:
    for _, path in candidates(root):
        if (path / MARKER_FILE).is_file():
            return path
    return None


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def find_latest(
    root: Path, map_location: str | torch.device = "cpu", on_skip: Callable[[str], None] = warn
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads; each skipped one is reported with its reason."""
    for _, path in candidates(root):
        try:
            return path, load_state(path, map_location)
        except InvalidCheckpoint as e:
            on_skip(f"skipping checkpoint {path / STATE_FILE}: {e}; falling back to the previous one")
    return None


def resolve_resume(
    resume: str, root: Path, map_location: str | torch.device = "cpu", on_skip: Callable[[str], None] = warn
) -> tuple[Path, dict[str, Any]] | None:
    """`auto` -> newest valid or None; `never` -> None; a path -> that checkpoint or BadInput."""
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(root, map_location, on_skip)
    path = Path(resume).expanduser()
    if path.is_file() and path.name == STATE_FILE:
        path = path.parent
    if not path.is_dir():
        raise ConfigError(
            "checkpoint.resume",
            f"{path} does not exist",
            "use auto, never, or a checkpoint folder such as RUN_DIR/checkpoints/step-000000100",
        )
    try:
        return path, load_state(path, map_location)
    except InvalidCheckpoint as e:
        raise ConfigError(
            "checkpoint.resume",
            f"{path} is not a valid checkpoint: {e}",
            "pick another checkpoint or use checkpoint.resume=auto",
        ) from None


def clean_stale(root: Path) -> list[Path]:
    """Finish or undo what crashed saves left (rank 0, at start): put back a replaced checkpoint whose
    successor never landed, then remove temp folders and uncommitted step folders."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        if p.name.startswith(REPLACED_PREFIX):
            original = root / p.name[len(REPLACED_PREFIX) :].rsplit("-", 1)[0]
            if not original.exists() and verify(p) is None:
                os.rename(p, original)
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in root.iterdir():
        stale_tmp = p.name.startswith(TMP_PREFIX)
        uncommitted = parse_step(p.name) is not None and p.is_dir() and not (p / MARKER_FILE).exists()
        if stale_tmp or uncommitted:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def apply_retention(root: Path, keep: int, metric: str = "val_acc") -> list[Path]:
    """Keep the newest `keep` committed checkpoints plus the best by `metric`; delete the rest."""
    committed = [(step, p) for step, p in candidates(root) if (p / MARKER_FILE).is_file()]
    keep_paths = {p for _, p in committed[:keep]}
    scored = []
    for _, p in committed:
        try:
            value = read_marker(p).get(metric)
        except (ValueError, OSError):
            value = None
        if isinstance(value, (int, float)):
            scored.append((value, p))
    if scored:
        keep_paths.add(max(scored, key=lambda item: item[0])[1])
    removed = []
    for _, p in committed:
        if p not in keep_paths:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def detach_copy(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU, so training can go on while it is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: detach_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [detach_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(detach_copy(v) for v in obj)
    return obj


class Snapshot:
    """A CPU copy of a state in reused buffers, handed to the writer thread. `ready()` before reading
    it (CUDA: waits for the non-blocking copies), `release()` once written (the buffers may be reused)."""

    def __init__(self, state: Any, event: Any, release: Callable[[], None]) -> None:
        self.state, self._event, self.release = state, event, release

    def ready(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def write_with(self, fn: Callable[[Any], CommitInfo]) -> CommitInfo:
        """ready(), fn(state), then release(), also when fn fails."""
        try:
            self.ready()
            return fn(self.state)
        finally:
            self.release()


class _BufferSet:
    """One set of CPU tensors shaped like a state's tensors, found again by their path in the state."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.free = threading.Event()
        self.free.set()
        self.from_cuda = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, obj: Any, path: tuple[Any, ...] = ()) -> Any:
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self.buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.stride() != src.stride():
                buf = torch.empty_like(src, device="cpu", pin_memory=src.is_cuda)  # pinned: async copy
                self.buffers[path] = buf
            self.from_cuda = self.from_cuda or src.is_cuda
            self.pending.append((buf, src))
            return buf
        if isinstance(obj, dict):
            return {k: self.copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.copy(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self.copy(v, (*path, i)) for i, v in enumerate(obj))
        return obj


class SnapshotBuffers:
    """Reused CPU copies of the training state for asynchronous saves.

    Why: copying ~100 MB into freshly allocated memory at every save costs a page fault per 4 KiB
    page, which made the training stall of an async save 0.17-0.28x a synchronous save; copy_ into
    the pages of an earlier snapshot costs only the copy. On CUDA the buffers are pinned and filled by
    non-blocking copies; an event tells the writer when they have landed, so training is not stalled
    by the device either. Two sets alternate: a snapshot is taken into the set that the writer is not
    writing, and a set is never refilled before the write that used it has released it (the wait is
    normally free: AsyncWriter runs one write at a time, so the write two snapshots back is done)."""

    def __init__(self, sets: int = 2) -> None:
        self._sets = [_BufferSet() for _ in range(max(1, sets))]
        self._next = 0
        self._helper: ThreadPoolExecutor | None = None

    def _copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """copy_ every (buffer, source) pair. copy_ spreads a large tensor over torch's threads; with
        one torch thread (one CPU rank per core) half of the bytes go to a helper thread instead
        (copy_ releases the GIL), so two cores fill the buffers while training waits: ~1.3x faster."""
        if len(pairs) < 2 or torch.get_num_threads() > 1 or any(src.is_cuda for _, src in pairs):
            for buf, src in pairs:
                buf.copy_(src, non_blocking=src.is_cuda)
            return
        total = sum(src.nbytes for _, src in pairs)
        mine, theirs, seen = [], [], 0
        for buf, src in sorted(pairs, key=lambda p: -p[1].nbytes):
            (theirs if seen < total / 2 else mine).append((buf, src))
            seen += src.nbytes
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-copy")
        helped = self._helper.submit(lambda: [b.copy_(s) for b, s in theirs])
        for buf, src in mine:
            buf.copy_(src)
        helped.result()

    def take(self, state: dict[str, Any], timeout_s: float | None = None) -> Snapshot:
        """Copy `state` into the next set; waits (up to timeout_s, None = as long as it takes) for the
        write that still holds that set. TimeoutError when it is still held after timeout_s."""
        chosen = self._sets[self._next]
        if not chosen.free.wait(timeout_s):
            raise TimeoutError("snapshot buffers still being written")
        self._next = (self._next + 1) % len(self._sets)
        chosen.free.clear()
        try:
            chosen.from_cuda, chosen.pending = False, []
            copied = chosen.copy(state)
            self._copy_all(chosen.pending)
            chosen.pending = []
            event = None
            if chosen.from_cuda:  # the copies are queued on the current stream: mark where they end
                event = torch.cuda.Event()
                event.record()
        except BaseException:
            chosen.free.set()
            raise
        return Snapshot(copied, event, chosen.free.set)


class AsyncWriter:
    """One background save at a time: submit() waits for the previous save, then starts the next."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: CommitInfo | None = None

    def submit(self, fn: Callable[[], CommitInfo]) -> None:
        self.wait()

        def run() -> None:
            try:
                self.last = fn()
            except BaseException as e:  # surfaced on the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> CommitInfo | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last


# ----------------------------------------------------------------------------------------------
# Pieces shared by the Trainer and train/api.py: one commit path, one RNG capture.


def commit_with_retention(
    root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep: int, replace: bool = False
) -> CommitInfo:
    """Commit one checkpoint, then prune to the newest `keep` (+ best): what every save does."""
    info = write_checkpoint(root, step, state, meta, replace=replace)
    apply_retention(root, keep)
    return info


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states (torch, CUDA, numpy, python) in weights_only-loadable types."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back what capture_rng() took, so the next random draw is the one the saved run made."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
