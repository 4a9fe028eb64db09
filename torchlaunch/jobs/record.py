"""The job record: who runs this job, where, with which command, since when, and how it ended.

One file per node, RUN_DIR/job/node-<N>.json, written atomically by that node's launcher at start and
again at the end (outcome, exit code, reason). It is the one handle `python -m launch status|cancel`
needs for a job started by any launcher: the scheduler and its job id (Slurm, Kubernetes) or the host
and launcher pid (local). A cancel request is a separate file, RUN_DIR/job/cancel.json, naming the
launch it stops, so that the same launch command run later (a new launch id) is not cancelled by it.

Reading is tolerant: a forged, truncated or non-UTF-8 record becomes a problem string, and every field
is type-checked on its own, so a bad value is dropped rather than crashing `status`.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from torchlaunch import contract, rundir
from torchlaunch.base import procs
from torchlaunch.base.files import as_float, as_int, as_str, read_json
from torchlaunch.jobs import proof, schedulers

VERSION = 1
JOB_DIR = rundir.JOB
CANCEL_FILE = "cancel.json"
OUTCOMES = ("finished", "failed", "bad_input", "preempted", "hung", "cancelled")
MAX_NODES = 1 << 16
LAUNCH_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""A launch id names files (status records): never a path or a glob pattern."""


@dataclass(frozen=True)
class JobRecord:
    """One node's launcher: identity and, once it ended, its outcome."""

    launch_id: str
    scheduler: str = "local"
    job_id: str | None = None
    host: str | None = None
    node_rank: int = 0
    nnodes: int = 1
    local_ranks: int | None = None
    launcher_pid: int | None = None
    launcher_start: int | None = None
    command: tuple[str, ...] = ()
    cwd: str | None = None
    started: float | None = None
    ended: float | None = None
    code: int | None = None
    outcome: str | None = None
    reason: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["command"] = list(self.command)
        data["version"] = VERSION
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobRecord | None:
        """The record with each field checked; None without a usable launch id."""
        launch_id = as_str(data.get("launch_id"), 64)
        if not launch_id or not LAUNCH_ID.match(launch_id):
            return None
        scheduler = as_str(data.get("scheduler"), 16)
        command = data.get("command")
        outcome = as_str(data.get("outcome"), 32)
        extra = data.get("extra")
        return cls(
            launch_id=launch_id,
            scheduler=scheduler if schedulers.get(scheduler) is not None else "local",
            job_id=as_str(data.get("job_id"), 256),
            host=as_str(data.get("host"), 256),
            node_rank=as_int(data.get("node_rank"), 0, MAX_NODES) or 0,
            nnodes=as_int(data.get("nnodes"), 1, MAX_NODES) or 1,
            local_ranks=as_int(data.get("local_ranks"), 0, 1 << 16),
            launcher_pid=as_int(data.get("launcher_pid"), 2, 1 << 31),
            launcher_start=as_int(data.get("launcher_start"), 0),
            command=tuple(c[:4096] for c in command[:1000] if isinstance(c, str)) if isinstance(command, list) else (),
            cwd=as_str(data.get("cwd")),
            started=as_float(data.get("started"), 0),
            ended=as_float(data.get("ended"), 0),
            code=as_int(data.get("code"), -255, 255),
            outcome=outcome if outcome in OUTCOMES else None,
            reason=as_str(data.get("reason"), 1000),
            extra={str(k)[:64]: v[:1000] for k, v in list(extra.items())[:32] if isinstance(v, str)}
            if isinstance(extra, dict)
            else {},
        )

    def launcher_alive(self) -> bool | None:
        """True/False when this host can tell (a local launcher on this host), else None: under Slurm
        or Kubernetes the scheduler answers for the job (the submitting process may be long gone)."""
        backend = schedulers.get(self.scheduler)
        if backend is None or not backend.by_pid or self.launcher_pid is None or self.host != socket.gethostname():
            return None
        return procs.same_process(self.launcher_pid, self.launcher_start)


K8S_JOB_ENV = contract.K8S_JOB
K8S_NAMESPACE_ENV = contract.K8S_NAMESPACE


def scheduler_from_env(env: Mapping[str, str]) -> tuple[str, str | None, dict[str, str]]:
    """(scheduler, job id, extra) of the launcher's own environment: the registered backend that
    recognises it (a Kubernetes pod, a Slurm allocation...), else local (torchlaunch.jobs.schedulers)."""
    found = schedulers.detect(env)
    return found.scheduler, found.job_id, dict(found.extra)


def job_dir(run_dir: str | Path) -> Path:
    return rundir.job(run_dir)


def record_path(run_dir: str | Path, node_rank: int = 0) -> Path:
    return job_dir(run_dir) / f"node-{node_rank}.json"


def new_launch_id() -> str:
    return uuid.uuid4().hex[:12]


def start(
    run_dir: str | Path,
    *,
    scheduler: str,
    command: Sequence[str],
    launch_id: str | None = None,
    job_id: str | None = None,
    node_rank: int = 0,
    nnodes: int = 1,
    local_ranks: int | None = None,
    extra: dict[str, str] | None = None,
    token: str | None = None,
) -> JobRecord:
    """Record this launcher (this process) as running the job on this node; returns the record.
    `token` (given to the launcher's children, see jobs.proof) is recorded only as its digest."""
    if schedulers.get(scheduler) is None:
        raise ValueError(f"scheduler {scheduler!r} is not one of {schedulers.names()}")
    pid = os.getpid()
    rec = JobRecord(
        launch_id=launch_id or new_launch_id(),
        scheduler=scheduler,
        job_id=job_id,
        host=socket.gethostname(),
        node_rank=node_rank,
        nnodes=nnodes,
        local_ranks=local_ranks,
        launcher_pid=pid,
        launcher_start=procs.start_ticks(pid),
        command=tuple(command),
        cwd=os.getcwd(),
        started=time.time(),
        extra={**(extra or {}), **({proof.DIGEST_KEY: proof.digest(token)} if token else {})},
    )
    rundir.write_json(record_path(run_dir, node_rank), rec.to_json(), real_folder=True)
    return rec


def finish(run_dir: str | Path, rec: JobRecord, code: int, outcome: str, reason: str = "") -> JobRecord:
    """Record how this node's launch ended (outcome is one of OUTCOMES)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
    done = replace(rec, ended=time.time(), code=code, outcome=outcome, reason=reason[:1000])
    rundir.write_json(record_path(run_dir, rec.node_rank), done.to_json(), real_folder=True)
    return done


def read_all(run_dir: str | Path) -> tuple[list[JobRecord], list[str]]:
    """Every node's record (by node rank) and one problem line per unusable file."""
    records: list[JobRecord] = []
    problems: list[str] = []
    folder = job_dir(run_dir)
    try:
        paths = sorted(p for p in folder.glob("node-*.json") if p.is_file())
    except OSError:
        paths = []
    for path in paths[:MAX_NODES]:
        data, why = read_json(path)
        rec = JobRecord.from_json(data) if data is not None else None
        if rec is None:
            problems.append(f"{path.name}: {why or 'no launch_id'} (ignored)")
        else:
            records.append(rec)
    return sorted(records, key=lambda r: r.node_rank), problems


ELASTIC_JOB = "elastic_job"
"""JobRecord.extra key: the elastic job (launch.elastic.job_key) an elastic launcher belongs to. Each of
an elastic job's launchers is a launch of its own (its own id, record and node slot); the job is the
set of them, and `status` and `cancel` treat it as one."""


def elastic_job(rec: JobRecord) -> str | None:
    return rec.extra.get(ELASTIC_JOB) or None


def request_cancel(run_dir: str | Path, launch_id: str, how: str, job: str | None = None) -> None:
    """Ask the launch `launch_id` (and, for an elastic job, every launcher of `job`) to stop for good
    (each launcher maps the ensuing exit to cancelled)."""
    rundir.write_json(
        job_dir(run_dir) / CANCEL_FILE,
        {"launch_id": launch_id, "job": job, "requested": time.time(), "how": how, "host": socket.gethostname()},
        real_folder=True,
    )


def cancel_request(run_dir: str | Path) -> tuple[str | None, float | None]:
    """(launch id, request time) of the cancel request, or (None, None)."""
    data, _ = read_json(job_dir(run_dir) / CANCEL_FILE)
    launch = as_str(data.get("launch_id"), 64) if data is not None else None
    if data is None or not launch or not LAUNCH_ID.match(launch):
        return None, None
    return launch, as_float(data.get("requested"), 0)


def cancel_job(run_dir: str | Path) -> str | None:
    """The elastic job a cancel request stops as a whole, if it named one."""
    data, _ = read_json(job_dir(run_dir) / CANCEL_FILE)
    return as_str(data.get("job"), 512) or None if data is not None else None


def cancel_requested(run_dir: str | Path, launch_id: str, job: str | None = None) -> bool:
    """For the launcher at its end: was this launch, or the elastic job it belongs to, asked to stop for good?"""
    return cancel_request(run_dir)[0] == launch_id or (job is not None and cancel_job(run_dir) == job)
