"""Read a run dir (and, when available, the scheduler) into state.Facts: every side effect of
`status` and `list` lives here, so the decision in state.py stays a pure function.

The scheduler is asked only when its tool is installed, with a short timeout, and its answer is one
word for `state.scheduler_word`; a missing tool or a failing query leaves the decision to the run dir.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.ops import progress, record
from torchlaunch.ops.files import read_json
from torchlaunch.ops.state import Checkpoint, Facts, current_launch

QUERY_TIMEOUT_S = 10.0
SLURM_ID = re.compile(r"^\d+(_\d+)?(\+\d+)?$")
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def newest_checkpoint(run_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies (commit marker, size and checksum: the store's latest_valid,
    what "does this run have a checkpoint" means everywhere), and why newer ones were skipped.
    torchlaunch.core.checkpoint is imported here only, when a checkpoint folder exists: it loads torch,
    which `status` of a run without checkpoints never needs."""
    root = rundir.checkpoints(run_dir)
    if not root.is_dir():
        return None, []
    from torchlaunch.core import checkpoint as ckpt

    skipped: list[str] = []
    try:
        path = ckpt.latest_valid(root, lambda p, why: skipped.append(f"checkpoint {p.name} skipped: {why}"))
    except (OSError, ValueError) as e:
        return None, [*skipped, f"checkpoints cannot be read ({e})"]
    if path is None:
        return None, skipped
    try:
        committed = (path / ckpt.MARKER_FILE).stat().st_mtime
    except OSError:
        committed = None
    step = ckpt.parse_step(path.name)
    return Checkpoint(step if step is not None else 0, str(path), committed), skipped


def rank_codes(run_dir: Path, launch_id: str) -> list[tuple[int, int, str]]:
    """Records torchlaunch.status left for this launch (read only: the launcher consumes them)."""
    out = []
    for path in sorted(rundir.status(run_dir).glob(f"{launch_id}-rank*.json"))[:4096]:
        data, _ = read_json(path)
        if data is None:
            continue
        code, rank, reason = data.get("code"), data.get("rank"), data.get("reason")
        if isinstance(code, int) and isinstance(rank, int) and not isinstance(code, bool):
            out.append((rank, code, reason if isinstance(reason, str) else ""))
    return out


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def slurm_state(job_id: str) -> str | None:
    """squeue while the job is known to the controller, else sacct's final state."""
    if not SLURM_ID.match(job_id):
        return None
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if out and out.strip():
        return out.split()[0]
    out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    lines = [ln.strip() for ln in (out or "").splitlines() if ln.strip()]
    return lines[-1] if lines else None


def kubectl_state(name: str, namespace: str | None) -> str | None:
    """A Kubernetes Job's state in Slurm's words (scheduler_word reads both)."""
    if not K8S_NAME.match(name) or (namespace is not None and not K8S_NAME.match(namespace)):
        return None
    argv = ["kubectl", "get", "job", name, "-o", "json"] + (["--namespace", namespace] if namespace else [])
    out = _run(argv)
    if not out:
        return None
    try:
        job = json.loads(out)
        status = job.get("status", {}) if isinstance(job, dict) else {}
    except ValueError:
        return None
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or [] if isinstance(c, dict)}
    if conditions.get("Complete") == "True":
        return "COMPLETED"
    if conditions.get("Failed") == "True":
        return "FAILED"
    if status.get("active"):
        return "RUNNING" if status.get("ready") else "PENDING"
    return "PENDING"


def scheduler_state(rec: record.JobRecord) -> str | None:
    if rec.scheduler == "slurm" and rec.job_id:
        return slurm_state(rec.job_id)
    if rec.scheduler == "k8s" and rec.job_id:
        return kubectl_state(rec.job_id, rec.extra.get("namespace"))
    return None


def facts(
    run_dir: Path, *, hang_timeout: float | None = None, ask_scheduler: bool = True, checkpoints: bool = True
) -> Facts:
    """Everything `state.decide` needs; `checkpoints=False` skips verifying them (`list`)."""
    records, problems = record.read_all(run_dir)
    beats, beat_problems = progress.read_all(progress.folder(run_dir))
    checkpoint, skipped = newest_checkpoint(run_dir) if checkpoints else (None, [])
    cancel_launch, _ = record.cancel_request(run_dir)
    nodes = current_launch(records)
    launch = nodes[0].launch_id if nodes else None
    return Facts(
        records=records,
        alive={r.node_rank: r.launcher_alive() for r in nodes},
        cancel_launch=cancel_launch,
        rank_codes=rank_codes(run_dir, launch) if launch else (),
        beats=beats,
        checkpoint=checkpoint,
        scheduler_state=scheduler_state(nodes[0]) if nodes and ask_scheduler else None,
        hang_timeout=hang_timeout,
        now=time.time(),
        problems=[*problems, *beat_problems, *skipped],
    )
