"""Retention: which committed checkpoints are kept (the newest `keep` that verify, the best by a
metric) and which are deleted; folders that would count but do not verify go to quarantine, never
counted, so corrupt or forged folders cannot push good checkpoints out.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from torchlaunch.base.untrusted import quote
from torchlaunch.core.checkpoint.discovery import (
    _VERIFIED,
    MARKER_FILE,
    candidates,
    newer_format,
    parse_step,
    quarantine,
    read_marker,
    verify,
    warn,
)
from torchlaunch.core.checkpoint.formats import (
    unknown_format,
)


def retain(
    root: Path, keep: int, committed: Path | None = None, metric: str = "val_acc", on_warn: Callable[[str], None] = warn
) -> list[Path]:
    """Keep the newest `keep` checkpoints that verify (the one just committed, `committed`, always among
    them) and the best verified one by `metric`; delete the other committed folders. A folder that would
    count but does not verify is moved to quarantine (one warning naming them all), never counted, so
    corrupt or forged folders cannot push good checkpoints out. Verified folders newer than `committed`
    (another lineage, e.g. after a resume from an explicit older checkpoint) are kept, not counted.
    A root that became a link (planted after the save) deletes nothing: retention never reaches through."""
    if root.is_symlink():
        on_warn(f"retention skipped: {quote(str(root))} is a symlink now (nothing is deleted through it)")
        return []
    ordered = [(step, p) for step, p in candidates(root) if (p / MARKER_FILE).is_file()]
    committed_step = parse_step(committed.name) if committed is not None else None
    kept: list[Path] = [] if committed is None else [committed]
    foreign: list[Path] = []
    bad: list[tuple[Path, str]] = []
    unchecked: list[Path] = []
    for step, p in ordered:
        if p == committed:
            continue
        if len(kept) >= keep and (committed_step is None or step < committed_step):
            unchecked.append(p)  # older than what is kept: deleted unless it is the best by metric
            continue
        reason = verify(p)
        if reason is not None and _is_newer(p):
            foreign.append(p)  # a newer torchlaunch's: likely valid, never moved
        elif reason is not None:
            bad.append((p, reason))
        elif committed_step is not None and step > committed_step:
            foreign.append(p)
        else:
            kept.append(p)
    best = _best_verified(unchecked, metric, kept)
    if bad:
        moved = [(p.name, reason, quarantine(root, p)) for p, reason in bad]
        on_warn(
            "checkpoint folders that do not verify were moved aside, not trusted and not counted by retention: "
            + "; ".join(f"{name} ({reason}) -> {dest}" for name, reason, dest in moved)
        )
    keep_paths = {*kept, *foreign, *([best] if best is not None else [])}
    removed = []
    for p in unchecked:
        if p not in keep_paths:
            shutil.rmtree(p, ignore_errors=True)
            _VERIFIED.pop(p, None)
            removed.append(p)
    return removed


def _is_newer(path: Path) -> bool:
    """Written by a newer torchlaunch (format_version) or in a checkpoint format this build does not know."""
    try:
        marker = read_marker(path)
        return newer_format(marker) is not None or unknown_format(marker) is not None
    except (OSError, ValueError):
        return False


def _best_verified(others: list[Path], metric: str, kept: list[Path]) -> Path | None:
    """The folder with the highest `metric` among kept + others, when it is one of the others and verifies."""

    def score(p: Path) -> float | None:
        try:
            value = read_marker(p).get(metric)
        except (ValueError, OSError):
            return None
        return float(value) if isinstance(value, (int, float)) else None

    scored = sorted(((v, p) for p in [*kept, *others] if (v := score(p)) is not None), key=lambda t: -t[0])
    for _, p in scored:
        if p in kept:
            return None
        if verify(p) is None:
            return p
    return None


def apply_retention(root: Path, keep: int, metric: str = "val_acc", committed: Path | None = None) -> list[Path]:
    """retain() for callers that did not just commit (tools, tests): nothing is protected as new."""
    return retain(root, keep, committed, metric)
