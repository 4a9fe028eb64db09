"""Checkpoint discovery: the names of the layout, commit markers, the run a checkpoint belongs to,
verification (cached while a folder is unchanged), safe loading through the folder's format, which
checkpoint a path means, the newest valid one, and the repairs at start (stale temp folders, quarantine).

A folder whose marker does not match its bytes is never trusted: it is moved to checkpoints/quarantine/
(quarantine), so a corrupt or forged folder is never resumed; retention.py counts only folders that verify.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchlaunch import rundir
from torchlaunch.base.storage import StorageError
from torchlaunch.base.untrusted import load_json, quote
from torchlaunch.core.checkpoint.formats import (
    CheckpointFormat,
    InvalidCheckpoint,
    expected_checksum,
    get_format,
    marker_format,
    unknown_format,
)
from torchlaunch.core.checkpoint.single_file import STATE_FILE
from torchlaunch.exit_codes import BadInput, ConfigError

FORMAT_VERSION = 1
MARKER_FILE = "COMMITTED.json"
STEP_DIR = re.compile(r"^step-(\d+)$", re.ASCII)
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
QUARANTINE_DIR = rundir.QUARANTINE
ROOT_NAME = rundir.CHECKPOINTS
"""RUN_DIR/checkpoints: the layout where a checkpoint is tied to its run (RUN_ID_FILE beside it)."""
RUN_ID_FILE = rundir.RUN_ID
"""RUN_DIR/run_id.json: the run's identity, written once at its first start; every marker carries it,
so a checkpoint folder copied in from another run is not resumed as this run's own."""
MAX_MARKER_BYTES = 1 << 20
"""Larger commit markers are refused unread: a marker is a few hundred bytes."""


class CheckpointError(Exception):
    """A checkpoint could not be written; the message says why and what survived."""


STORAGE_MARK = "checkpoint error: storage: "
"""How a storage refusal's message starts, so that every rank (which sees rank 0's message only as
text) raises the same kind."""


class CheckpointStorageError(CheckpointError, StorageError):
    """The run dir's storage refused the save (full, over quota, read-only): exit 2, not 1. A retry
    would redo every step since the last checkpoint and fail at this same save, so the scheduler must
    not retry until someone frees space; the previous checkpoint is intact."""


def checkpoint_error(message: str) -> CheckpointError:
    """The exception for a save failure known by its message (from rank 0, to every rank)."""
    return CheckpointStorageError(message) if message.startswith(STORAGE_MARK) else CheckpointError(message)


class NewerFormat(BadInput):
    """A checkpoint written by a newer torchlaunch (or in a checkpoint format this process has not
    registered): refused in one line (exit 2) and left in place, since it is likely valid (never quarantined, never skipped for an older step)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def parse_step(name: str) -> int | None:
    """Step number of a checkpoint folder name, as an integer (never compared as text)."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def read_marker(path: Path) -> dict[str, Any]:
    """The commit marker's fields. Only finite numbers: a marker is written by json.dump of ints,
    floats and strings, so NaN or Infinity means a forged or damaged file (ValueError, like bad JSON)."""
    with open(path / MARKER_FILE, "rb") as fh:
        raw = fh.read(MAX_MARKER_BYTES + 1)
    if len(raw) > MAX_MARKER_BYTES:
        raise ValueError(f"the commit marker is larger than {MAX_MARKER_BYTES} bytes")
    marker = load_json(raw, max_depth=8)  # depth, NaN/Infinity: ValueError, like bad JSON
    if not isinstance(marker, dict):
        raise ValueError("the commit marker is not a JSON object")
    return marker


def _marker_problem(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(reason, marker): the reason is None when the marker is present and well-formed."""
    if not (path / MARKER_FILE).is_file():
        return "no commit marker (the save never finished)", {}
    try:
        marker = read_marker(path)
        expected_checksum(marker), int(marker["bytes"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
        return f"unreadable commit marker ({str(e)[:200]})", {}
    place = _place_problem(path, marker)
    if place is not None:
        return place, marker
    unknown = unknown_format(marker)
    if unknown is not None:
        return unknown, marker
    return _format(marker).check(path, marker), marker


def _format(marker: dict[str, Any]) -> CheckpointFormat:
    """The registered format that wrote a marker's folder (checked by unknown_format first)."""
    return get_format(marker_format(marker))


def newer_format(marker: dict[str, Any]) -> int | None:
    """The marker's format_version when it is newer than this build reads, else None."""
    version = marker.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        return version
    return None


def _place_problem(path: Path, marker: dict[str, Any]) -> str | None:
    """Why a committed folder is not the checkpoint its place says (None when it is): the folder's
    name, the marker's step and the run the marker belongs to must agree, so a copy of step 10 named
    step-000999999, or a folder copied in from another run, is never resumed as this run's newest."""
    version = newer_format(marker)
    if version is not None:
        return f"written in format_version {version} by a newer torchlaunch (this build reads {FORMAT_VERSION})"
    folder_step, marker_step = parse_step(path.name), marker.get("step")
    if (
        folder_step is not None
        and "step" in marker
        and (isinstance(marker_step, bool) or not isinstance(marker_step, int) or marker_step != folder_step)
    ):
        return f"its marker is of step {quote(marker_step, 40)}, not {folder_step} (a copied or renamed folder)"
    if path.parent.name != ROOT_NAME:
        return None
    try:
        run = recorded_run(path.parent.parent)
    except BadInput:  # refused at resume (ensure_run) before anything is moved; readers carry on
        return None
    if run is None:
        return None
    owner = marker.get("run_id")
    if owner is None:  # committed before runs had an identity: this run's own only if older than it
        committed = marker.get("committed_at")
        if not isinstance(committed, int | float) or isinstance(committed, bool) or committed <= run[1]:
            return None
        return "its marker names no run and is newer than this run's identity (copied from another run?)"
    if owner != run[0]:
        return f"it belongs to run {quote(owner, 40)}, this run dir is run {run[0]} (copied from another run?)"
    return None


_RUNS: dict[Path, tuple[tuple[int, int], tuple[str, float]]] = {}
"""run dir -> (file identity, (run_id, created_at)) of its RUN_ID_FILE, read once per change."""


def recorded_run(run_dir: Path) -> tuple[str, float] | None:
    """(run_id, created_at) from RUN_DIR/run_id.json; None when the run has none yet. A damaged or
    forged record is bad input: which checkpoints are this run's cannot be told without it."""
    file = run_dir / RUN_ID_FILE
    try:
        st = file.lstat()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadInput(f"checkpoint error: cannot read {file}: {e.strerror or e} (make the run dir readable)") from None
    cached = _RUNS.get(run_dir)
    if cached is not None and cached[0] == (st.st_ino, st.st_mtime_ns):
        return cached[1]
    regular = file.is_file() and not file.is_symlink()
    problem = "not a regular file" if not regular else "larger than 4096 bytes"
    if regular and st.st_size <= 4096:
        try:
            data = load_json(file.read_bytes(), max_depth=2)
            run = (data["run_id"], float(data["created_at"]))
            if isinstance(run[0], str) and re.fullmatch(r"[0-9a-f]{32}", run[0]) and run[1] == run[1]:
                _RUNS[run_dir] = ((st.st_ino, st.st_mtime_ns), run)
                return run
            problem = "not a run identity"
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            problem = f"unreadable ({str(e)[:100]})"
    raise BadInput(
        f"checkpoint error: {file} is {problem} (restore it: its run_id is the one in this run's "
        "checkpoints/step-*/COMMITTED.json, with created_at before their committed_at)"
    )


def ensure_run(root: Path) -> str | None:
    """This run's id (RUN_DIR/run_id.json created at its first start, atomically and exactly once);
    None for a checkpoint root outside the RUN_DIR/checkpoints layout, which has no run to belong to."""
    if root.name != ROOT_NAME:
        return None
    run_dir = root.parent
    run = recorded_run(run_dir)
    if run is not None:
        return run[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{TMP_PREFIX}{RUN_ID_FILE}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps({"run_id": uuid.uuid4().hex, "created_at": time.time()}))
    try:
        os.link(tmp, run_dir / RUN_ID_FILE)  # exclusive: two first starts agree on one identity
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    rundir.fsync_dir(run_dir)
    run = recorded_run(run_dir)
    return run[0] if run is not None else None


def check_root(root: Path) -> None:
    """RUN_DIR/checkpoints must be a real folder of this run dir (or not exist yet): a symlink would
    resume another run's state and let retention delete its checkpoints; a dangling one or a file
    there could not be written. One line, exit 2 (the run dir's one check, rundir.check_real_folder)."""
    rundir.check_real_folder(
        root,
        prefix="checkpoint error: ",
        what="checkpoints",
        fix="remove the link, or pass that run's own run_dir",
    )


def verify(path: Path) -> str | None:
    """None when the checkpoint folder is committed and its bytes match; else the reason.

    A folder this process committed or verified before, unchanged since (same file identity, size,
    modification time and marker), is not read again: retention verifies at every save."""
    try:
        reason, marker = _marker_problem(path)
    except OSError as e:  # moved or removed meanwhile
        return f"cannot be read: {e.strerror or e}"
    if reason is not None:
        return reason
    fmt = _format(marker)
    signature = _signature(path, fmt.files(path, marker))
    if signature is not None and _VERIFIED.get(path) == signature:
        return None
    problem = fmt.verify(path, marker)
    if problem is None and signature is not None:
        _VERIFIED[path] = signature
    return problem


_VERIFIED: dict[Path, tuple[int, ...]] = {}
"""Folders whose bytes matched their marker, with the file signature they had then."""


def _signature(path: Path, files: list[Path]) -> tuple[int, ...] | None:
    """Identity, size and modification time of the payload files and the marker (None: one is gone)."""
    try:
        stats = [f.stat() for f in [*files, path / MARKER_FILE]]
    except OSError:
        return None
    return tuple(n for st in stats for n in (st.st_ino, st.st_size, st.st_mtime_ns))


def _remember_verified(path: Path, files: list[Path]) -> None:
    signature = _signature(path, files)
    if signature is not None:
        _VERIFIED[path] = signature


def load_state(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify and load through the folder's checkpoint format (the single file: weights_only=True, a
    file that needs arbitrary code is refused, its checksum computed alongside the load). The state is
    returned only when its bytes match the marker; a newer format_version or a format this build does
    not know is NewerFormat (bad input), never a reason to skip."""
    reason, marker = _marker_problem(path)
    version = newer_format(marker)
    if version is not None:
        raise NewerFormat(
            f"checkpoint error: {path} was written in format_version {version} by a newer torchlaunch, this "
            f"build reads {FORMAT_VERSION} (resume with that version, or start a new run_dir; it is left as it is)"
        )
    unknown = unknown_format(marker) if marker else None
    if unknown is not None:
        raise NewerFormat(
            f"checkpoint error: {path} was {unknown} (import the package that registers it, or resume with the "
            "torchlaunch that wrote it; it is left as it is)"
        )
    if reason is not None:
        raise InvalidCheckpoint(reason)
    fmt = _format(marker)
    state = fmt.load_into(path, marker, {}, map_location)
    _remember_verified(path, fmt.files(path, marker))
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        version = state.get("format_version") if isinstance(state, dict) else None
        if newer_format({"format_version": version}) is not None:
            raise NewerFormat(
                f"checkpoint error: {path} holds format_version {version} of a newer torchlaunch, this build "
                f"reads {FORMAT_VERSION} (resume with that version, or start a new run_dir)"
            )
        raise InvalidCheckpoint(f"format version {quote(version, 40)}, this build reads {FORMAT_VERSION}")
    return state


def candidates(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint folders under root, newest step first."""
    if not root.is_dir():
        return []
    found = [
        (step, p)
        for p in root.iterdir()
        if not p.is_symlink() and p.is_dir() and (step := parse_step(p.name)) is not None
    ]
    return sorted(found, key=lambda item: item[0], reverse=True)


def newest_committed(root: Path) -> Path | None:
    """The newest folder with a commit marker, unverified: only for naming what survived a failed write."""
    for _, path in candidates(root):
        if (path / MARKER_FILE).is_file():
            return path
    return None


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Which checkpoint a path means


@dataclass(frozen=True)
class Located:
    """What a user-given path means. `kind`: "run" (a folder holding checkpoints/), "checkpoints" (a
    folder of step folders), "step" (one checkpoint folder; a state.pt inside one means its folder), or
    "file" (any other file, e.g. a plain state_dict). `root` is the checkpoints folder to search and
    `checkpoint` the one step folder named, where those apply."""

    path: Path
    kind: str
    root: Path | None = None
    checkpoint: Path | None = None


def locate(path: str | os.PathLike[str]) -> Located | None:
    """The one parser of checkpoint paths (resume, init_from, evaluation); None when nothing exists there."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.name == STATE_FILE and _looks_like_step(p.parent):
            return Located(p, "step", p.parent.parent, p.parent)
        return Located(p, "file")
    if not p.is_dir():
        return None
    if _looks_like_step(p):
        return Located(p, "step", p.parent, p)
    if rundir.checkpoints(p).is_dir():
        return Located(p, "run", rundir.checkpoints(p))
    if candidates(p) or p.name == ROOT_NAME:
        return Located(p, "checkpoints", p)
    return Located(p, "run", rundir.checkpoints(p))  # a run folder without checkpoints yet


def _looks_like_step(path: Path) -> bool:
    return parse_step(path.name) is not None or (path / MARKER_FILE).exists() or (path / STATE_FILE).exists()


SkipReport = Callable[[Path, str], None]
"""on_skip(path, reason): told about each checkpoint folder that was passed over, and why."""


def latest_valid(root: Path, on_skip: SkipReport | None = None) -> Path | None:
    """The newest checkpoint under root whose bytes verify (size + checksum); each newer one that does
    not is reported to on_skip(path, reason). What "does this run have a checkpoint" means everywhere."""
    for _, path in candidates(root):
        reason = verify(path)
        if reason is None:
            return path
        if on_skip is not None:
            on_skip(path, reason)
    return None


StateCheck = Callable[[Path, dict[str, Any]], "str | None"]
"""check(folder, state): why a loaded state cannot be used (missing keys, wrong types, another step
than its folder's), or None."""


def _load_checked(path: Path, map_location: str | torch.device, check: StateCheck | None) -> dict[str, Any]:
    state = load_state(path, map_location)
    problem = check(path, state) if check is not None else None
    if problem is not None:
        raise InvalidCheckpoint(f"its state is not usable: {problem}")
    return state


def find_latest(
    root: Path,
    map_location: str | torch.device = "cpu",
    on_skip: Callable[[str], None] = warn,
    move_invalid: bool = False,
    check: StateCheck | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, loads and passes `check`; each skipped one is reported with
    its reason. `move_invalid` (rank 0 at resume): skipped folders also go to quarantine, and the report
    says where. A newer format is NewerFormat (bad input), never skipped: it is likely valid."""
    for _, path in candidates(root):
        try:
            return path, _load_checked(path, map_location, check)
        except InvalidCheckpoint as e:
            moved = f"; moved to {quarantine(root, path)}" if move_invalid else ""
            on_skip(f"skipping checkpoint {path / STATE_FILE}: {e}{moved}; falling back to the previous one")
    return None


def resolve_resume(
    resume: str,
    root: Path,
    map_location: str | torch.device = "cpu",
    on_skip: Callable[[str], None] = warn,
    check: StateCheck | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """`auto` -> newest valid or None; `never` -> None; a path (checkpoint folder, its state.pt, a run
    or checkpoints folder: its newest valid one) -> that checkpoint, or BadInput."""
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(root, map_location, on_skip, check=check)
    found = locate(resume)
    if found is None or found.kind == "file":
        raise ConfigError(
            "checkpoint.resume",
            f"{Path(resume).expanduser()} does not exist or is not a checkpoint",
            "use auto, never, or a checkpoint folder such as RUN_DIR/checkpoints/step-000000100",
        )
    path = found.checkpoint or latest_valid(found.root or found.path)
    if path is None:
        raise ConfigError(
            "checkpoint.resume",
            f"{found.path} holds no valid checkpoint",
            "use auto, never, or a checkpoint folder such as RUN_DIR/checkpoints/step-000000100",
        )
    try:
        return path, _load_checked(path, map_location, check)
    except InvalidCheckpoint as e:
        raise ConfigError(
            "checkpoint.resume",
            f"{path} is not a valid checkpoint: {e}",
            "pick another checkpoint or use checkpoint.resume=auto",
        ) from None


# ----------------------------------------------------------------------------------------------
# Repair and quarantine


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


def quarantine(root: Path, path: Path) -> Path:
    """Move a committed folder that does not verify (or load) out of discovery, kept for inspection:
    ROOT/quarantine/NAME (NAME-N when taken). Returns where it went.

    Where ROOT/quarantine cannot take it (a file of that name, a folder on another filesystem: EXDEV,
    read-only), it is renamed within ROOT instead, to quarantine-NAME: still out of discovery, and a
    rename in the same folder never copies a checkpoint's bytes."""
    target_dir = root / QUARANTINE_DIR
    try:
        target_dir.mkdir(exist_ok=True)
        target = _free_name(target_dir, path.name)
        os.rename(path, target)
    except OSError:  # FileExistsError (a file named quarantine), NotADirectoryError, EXDEV, EROFS...
        target = _free_name(root, f"{QUARANTINE_DIR}-{path.name}")
        os.rename(path, target)
    _VERIFIED.pop(path, None)
    return target


def _free_name(folder: Path, name: str) -> Path:
    target, n = folder / name, 1
    while os.path.lexists(target):
        target, n = folder / f"{name}-{n}", n + 1
    return target
