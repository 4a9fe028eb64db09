"""Copies of a training state for asynchronous saves, and the one background writer.

Snapshots go into reused buffers (two sets, pinned + an event on CUDA), never into fresh memory per save:
that keeps the training stall of an async save at the cost of a copy, not of page faults.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from torchlaunch.core.checkpoint.store import CommitInfo


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

    def settle(self, drop: type[BaseException] | None = None) -> bool:
        """Wait for the save in flight without raising: a failure of type `drop` is forgotten (True:
        that commit was refused, the caller saves again); any other stays for the next wait()."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if drop is not None and isinstance(self._error, drop):
            self._error = None
            return True
        return False

    def wait(self) -> CommitInfo | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last
