"""The on-disk store: atomic commit, checksum, verification, locating, discovery, retention, safe loading.

Layout: RUN_DIR/checkpoints/step-000001234/{<the format's files>, COMMITTED.json}; the files are a
checkpoint format's (formats.py: write / check / verify / load_into), by default the single state.pt
(single_file.py). A checkpoint is valid only when its marker exists and the format says its files
match it. One name for three modules, each with one job: commit.py (the commit protocol), discovery.py
(markers, verification, which checkpoint a path means, the newest valid one, quarantine) and
retention.py (what is kept); callers and tests import them from here, with the format names the
store has always given (STATE_FILE, InvalidCheckpoint, ...).
"""

from __future__ import annotations

from torchlaunch.core.checkpoint.commit import (
    CommitGuard,
    CommitInfo,
    WriteShares,
    write_checkpoint,
)
from torchlaunch.core.checkpoint.discovery import _VERIFIED as _VERIFIED  # the tests' "a fresh process"
from torchlaunch.core.checkpoint.discovery import (
    FORMAT_VERSION,
    MARKER_FILE,
    MAX_MARKER_BYTES,
    QUARANTINE_DIR,
    REPLACED_PREFIX,
    ROOT_NAME,
    RUN_ID_FILE,
    STEP_DIR,
    STORAGE_MARK,
    TMP_PREFIX,
    CheckpointError,
    CheckpointStorageError,
    Located,
    NewerFormat,
    SkipReport,
    StateCheck,
    candidates,
    check_root,
    checkpoint_error,
    clean_stale,
    ensure_run,
    find_latest,
    latest_valid,
    load_state,
    locate,
    newer_format,
    newest_committed,
    parse_step,
    quarantine,
    read_marker,
    recorded_run,
    resolve_resume,
    step_dir_name,
    verify,
    warn,
)
from torchlaunch.core.checkpoint.formats import (
    DEFAULT_FORMAT,
    CheckpointFormat,
    InvalidCheckpoint,
    expected_checksum,
    get_format,
    marker_format,
    unknown_format,
)
from torchlaunch.core.checkpoint.retention import (
    apply_retention,
    retain,
)
from torchlaunch.core.checkpoint.single_file import STATE_FILE

__all__ = [
    "DEFAULT_FORMAT",
    "STATE_FILE",
    "CheckpointFormat",
    "InvalidCheckpoint",
    "expected_checksum",
    "get_format",
    "marker_format",
    "unknown_format",
    "CheckpointError",
    "CheckpointStorageError",
    "CommitGuard",
    "CommitInfo",
    "FORMAT_VERSION",
    "Located",
    "MARKER_FILE",
    "MAX_MARKER_BYTES",
    "NewerFormat",
    "QUARANTINE_DIR",
    "REPLACED_PREFIX",
    "ROOT_NAME",
    "RUN_ID_FILE",
    "STEP_DIR",
    "STORAGE_MARK",
    "SkipReport",
    "StateCheck",
    "TMP_PREFIX",
    "WriteShares",
    "apply_retention",
    "candidates",
    "check_root",
    "checkpoint_error",
    "clean_stale",
    "ensure_run",
    "find_latest",
    "latest_valid",
    "load_state",
    "locate",
    "newer_format",
    "newest_committed",
    "parse_step",
    "quarantine",
    "read_marker",
    "recorded_run",
    "resolve_resume",
    "retain",
    "step_dir_name",
    "verify",
    "warn",
    "write_checkpoint",
]
