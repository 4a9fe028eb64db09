"""Faults that need more than one signal: a crash provably in the middle of a checkpoint write.

The write of a small checkpoint takes milliseconds, so a poll-then-kill could land before or after
it. Instead: inotify wakes us on the first byte, the whole node is frozen with SIGSTOP (and we wait
until the kernel reports every process stopped), the run dir is inspected, and only if a checkpoint
is still uncommitted with bytes on disk is the node killed; otherwise it is thawed and we try the
next event. What was caught is returned, so the test can show the crash really was mid-write.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from faults import inotify, procs, progress
from faults.netns import Cluster, Node


@dataclass(frozen=True)
class MidWriteCrash:
    caught: progress.PartialWrite
    killed: list[int]
    attempts: int


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return "gone"
    return stat[stat.rindex(")") + 2]


def _stop_and_confirm(pids: list[int], timeout_s: float = 5.0) -> None:
    """SIGSTOP `pids` and wait until each is stopped ('T'/'t') or gone: no more bytes can land."""
    procs.signal_all(pids, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all(_state(pid) in ("T", "t", "gone", "Z", "X") for pid in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} did not stop within {timeout_s}s")
        time.sleep(0.001)


def crash_during_checkpoint_write(cluster: Cluster, node: Node, run_dir: str | Path, timeout_s: float) -> MidWriteCrash:
    """kill -9 `node` while a checkpoint under RUN_DIR/checkpoints is uncommitted with data in it."""
    root = Path(run_dir) / "checkpoints"
    deadline = time.monotonic() + timeout_s
    progress.wait_until(root.is_dir, timeout_s, f"{root} to exist")
    attempts = 0
    with inotify.Watch() as watch:
        watch.add(str(root))
        for entry in root.iterdir():
            if entry.is_dir():
                watch.add(str(entry))
        pids = [p.pid for p in node.processes()]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no checkpoint write caught in {timeout_s}s ({attempts} tries)")
            events = watch.read(remaining)
            for event in events:
                if event.is_dir and event.directory == str(root) and os.path.isdir(event.path):
                    watch.add(event.path)
            if not events:
                continue
            attempts += 1
            _stop_and_confirm(pids)
            caught = [w for w in progress.partial_writes(run_dir) if sum(w.files.values()) > 0]
            if caught:
                killed = cluster.kill_node(node)
                return MidWriteCrash(caught=caught[0], killed=killed, attempts=attempts)
            procs.signal_all(pids, signal.SIGCONT)
            pids = [p.pid for p in node.processes()]  # a restart may have replaced workers
