"""Checkpoints: the store (commit, verify, locate, latest_valid, retain), snapshots, and the Checkpointer.

Import from here; the submodules each have one job (store.py: the store's one name for commit.py, the
commit protocol on disk, discovery.py, markers, verification and quarantine, and retention.py;
formats.py: the checkpoint-format seam and its registry; single_file.py: the default format, one
state.pt; dcp.py: torch.distributed.checkpoint, each rank its share; shares.py: the collective write
of such a format; snapshot.py: copies for background saves and the writer thread; checkpointer.py:
collective save/load over the store; section.py: the `checkpoint.*` config section, torch-free).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_EXPORTS = {
    "checkpointer": (
        "ENVELOPE",
        "WORKER_KIND",
        "Checkpointer",
        "Loaded",
        "capture_rng",
        "envelope_problem",
        "kind_of",
        "restore_rank_rng",
        "restore_rng",
        "step_of",
    ),
    "formats": (
        "CHECKSUM",
        "DEFAULT_FORMAT",
        "CheckpointFormat",
        "InvalidCheckpoint",
        "create_new",
        "expected_checksum",
        "file_checksum",
        "get_format",
        "register_format",
        "unregister_format",
    ),
    "single_file": ("CHECKSUM_MISMATCH", "STATE_FILE", "SingleFile"),
    "snapshot": ("AsyncWriter", "Snapshot", "SnapshotBuffers", "detach_copy"),
    "store": (
        "FORMAT_VERSION",
        "MARKER_FILE",
        "MAX_MARKER_BYTES",
        "QUARANTINE_DIR",
        "REPLACED_PREFIX",
        "RUN_ID_FILE",
        "STEP_DIR",
        "TMP_PREFIX",
        "CheckpointError",
        "CommitInfo",
        "Located",
        "NewerFormat",
        "SkipReport",
        "apply_retention",
        "candidates",
        "check_root",
        "clean_stale",
        "ensure_run",
        "find_latest",
        "latest_valid",
        "load_state",
        "locate",
        "newest_committed",
        "parse_step",
        "quarantine",
        "read_marker",
        "resolve_resume",
        "retain",
        "step_dir_name",
        "verify",
        "warn",
        "write_checkpoint",
    ),
}
"""submodule -> the names it gives the package, loaded on first use (PEP 562), every submodule at once
(single_file registers the default format): the launchers read the checkpoint section (section.py)
without torch, which the store and the Checkpointer import."""


def __getattr__(name: str) -> Any:
    owner = next((module for module, names in _EXPORTS.items() if name in names), None)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for module in _EXPORTS:
        importlib.import_module(f"{__name__}.{module}")
    value = getattr(sys.modules[f"{__name__}.{owner}"], name)
    globals()[name] = value
    return value


__all__ = [name for names in _EXPORTS.values() for name in names]
