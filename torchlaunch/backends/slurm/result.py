"""Each Slurm task's result record: where a task leaves its exit code and reason as data (task.write_result),
beside submitit's own files, for `--wait` (follow.exit_status) and a live job's verdict (live.recorded_codes)."""

from __future__ import annotations

import os
from pathlib import Path

from torchlaunch.base import files


def result_path(folder: str | os.PathLike[str], job_id: str, task: int = 0) -> Path:
    """Where task `task` of `job_id` leaves its exit code and reason, beside submitit's own files."""
    return Path(folder) / f"{job_id}_{task}_result.json"


def read_result(folder: str | os.PathLike[str], job_id: str) -> tuple[int | None, str]:
    """(code, reason) task 0 of `job_id` recorded, or (None, "") when it left none (it was killed)."""
    data, _ = files.read_json(result_path(folder, job_id))
    if data is None:
        return None, ""
    return files.as_int(data.get("code"), 0, 255), files.as_str(data.get("why"), 1000) or ""
