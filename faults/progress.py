"""What a run has done so far, read from its run dir: metrics lines and checkpoints.

Fault points are chosen in training steps, and every wait polls the run dir with a deadline.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d+)$")
_DIGITS = re.compile(r"(\d+)")
POLL_S = 0.05


def train_steps(run_dir: str | Path) -> list[int]:
    """Steps of the train lines in RUN_DIR/metrics.jsonl (a torn last line is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    steps = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "loss" in record and "step" in record:
            steps.append(int(record["step"]))
    return steps


def last_step(run_dir: str | Path) -> int:
    """Highest train step logged so far, or -1."""
    return max(train_steps(run_dir), default=-1)


def wait_until(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    abort: Callable[[], str | None] = lambda: None,
) -> float:
    """Poll `condition` until true; returns seconds waited. `abort` returning a reason stops early."""
    start = time.monotonic()
    while not condition():
        reason = abort()
        if reason:
            raise RuntimeError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what} did not happen within {timeout_s}s")
        time.sleep(POLL_S)
    return time.monotonic() - start


def wait_for_step(
    run_dir: str | Path, step: int, timeout_s: float, abort: Callable[[], str | None] = lambda: None
) -> float:
    return wait_until(lambda: last_step(run_dir) >= step, timeout_s, f"step {step} in {run_dir}", abort)


def committed_checkpoints(run_dir: str | Path) -> list[int]:
    """Steps of checkpoints with a commit marker, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and (entry / "COMMITTED.json").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


@dataclass(frozen=True)
class PartialWrite:
    """A checkpoint entry caught before its commit: what it was and how far it got."""

    entry: str
    step: int
    files: dict[str, int]  # name -> bytes written so far

    def describe(self) -> str:
        sizes = ", ".join(f"{name}={size}B" for name, size in sorted(self.files.items())) or "empty"
        return f"{self.entry} (step {self.step}) uncommitted: {sizes}"


def partial_writes(run_dir: str | Path) -> list[PartialWrite]:
    """Entries under checkpoints/ for a step newer than every committed one, not yet committed.

    Works for both atomic schemes: a temp file/dir renamed at the end (any step: it may replace a
    checkpoint of the same step), or a step dir whose commit marker is written last. Older
    uncommitted step dirs are deletions by retention, not writes.
    """
    root = Path(run_dir) / "checkpoints"
    newest = max(committed_checkpoints(run_dir), default=-1)
    found = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        digits = _DIGITS.search(entry.name)
        temp = "tmp" in entry.name  # a temp name is a write in progress whatever its step
        if digits is None or (int(digits.group(1)) <= newest and not temp):
            continue
        if entry.is_dir() and (entry / "COMMITTED.json").exists():
            continue
        try:
            files = (
                {p.name: p.stat().st_size for p in entry.iterdir()}
                if entry.is_dir()
                else {entry.name: entry.stat().st_size}
            )
        except FileNotFoundError:
            continue
        found.append(PartialWrite(entry=entry.name, step=int(digits.group(1)), files=files))
    return found
