"""Each rank's outcome for the launcher that started it: one small JSON record per rank and attempt.

torchrun exits 1 whatever its workers returned, so launch.local cannot tell bad input (2) from a
preemption (75) by torchrun's code. Every program it starts (the built-in worker, the pre-flight, a
user's script) runs through torchlaunch.runner, which leaves `{code, reason, rank}` in the folder named by
TORCHLAUNCH_STATUS_DIR under the launch's attempt id (TORCHLAUNCH_ATTEMPT_ID). Stdlib only: the
launcher and the torch-free program runner import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torchlaunch.exit_codes import BAD_INPUT

ATTEMPT_ENV = "TORCHLAUNCH_ATTEMPT_ID"
"""Set by launch.local: the id of this launch; records of other launches are never read."""
STATUS_DIR_ENV = "TORCHLAUNCH_STATUS_DIR"
"""Set by launch.local: where the ranks of this node leave their records."""


def folder(run_dir: str | None = None) -> Path | None:
    """The status folder: the launcher's choice, else RUN_DIR/status (older launchers), else none."""
    chosen = os.environ.get(STATUS_DIR_ENV)
    if chosen:
        return Path(chosen)
    return Path(run_dir) / "status" if run_dir else None


def launched() -> bool:
    """True under launch.local, which prints a bad-input reason once for all ranks."""
    return bool(os.environ.get(ATTEMPT_ENV))


def report(rank: int, code: int, reason: str, run_dir: str | None = None) -> None:
    """Leave this rank's outcome for the launcher that started us (no-op without one)."""
    attempt = os.environ.get(ATTEMPT_ENV)
    where = folder(run_dir)
    if not attempt or where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".{attempt}-rank{rank}.tmp"
        tmp.write_text(json.dumps({"code": code, "reason": reason, "rank": rank}))
        os.replace(tmp, where / f"{attempt}-rank{rank}.json")  # the launcher never sees half a record
    except OSError:
        pass


def earlier_bad_input(run_dir: str | None = None) -> str | None:
    """After a torchrun restart within the same launch: the reason a rank already found bad input
    (a rerun would fail the same way, so the restarted group stops at once), else None."""
    attempt = os.environ.get(ATTEMPT_ENV)
    where = folder(run_dir)
    if not attempt or where is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return None
    for f in sorted(where.glob(f"{attempt}-rank*.json")):
        try:
            record = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if record.get("code") == BAD_INPUT:
            return str(record.get("reason", "bad input"))
    return None


def collect(where: Path, attempt: str) -> tuple[list[int], list[str]]:
    """The launcher's side: codes and reasons of this attempt's records, which are consumed."""
    codes, reasons = [], []
    for f in sorted(where.glob(f"{attempt}-rank*.json")):
        try:
            record = json.loads(f.read_text())
            codes.append(int(record["code"]))
            reasons.append(str(record.get("reason", "")))
        except (OSError, ValueError, KeyError):
            continue
        finally:
            f.unlink(missing_ok=True)
    return codes, reasons
