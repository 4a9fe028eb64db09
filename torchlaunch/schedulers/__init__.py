"""What the operator side knows about a scheduler, behind one interface, one module per backend.

A run dir is the job's handle whatever started it; what differs between schedulers is how to find a
job from inside it (`detect`), what the scheduler says about it (`state`, `alive`), how to stop it
(`cancel`), which of its own files hold output beside the ranks' logs (`logs`), and how a job proves
it belongs to a run dir (`claim`). `python -m launch status|logs|cancel|list`, the job record, the
run-dir lock and `launch.slurm --wait` ask a backend through `get(name)` and never branch on a
scheduler's name, so a new scheduler is one module that calls `register` (tests/test_seams.py adds
one, "a subprocess on this host", and operates it with no other change).

Modelled on TorchX's Scheduler (submit_dryrun / schedule / describe / log_iter / cancel). `render`
(the dry run) and `submit` delegate to the backend's launcher module (torchlaunch.launch.local, .slurm,
.k8s), which owns them: pure functions from a JobSpec to an argv, an sbatch script or manifests, and
the launcher's command line. A backend loads its launcher by name (`launcher`), only when one of the
two is called: the operator commands import this package without torch and without the launchers
(tests/test_seams.py checks both). Stdlib only.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torchlaunch.jobs.record import JobRecord


@dataclass(frozen=True)
class Step:
    """One thing `cancel` does: send SIGTERM to a pid on this host ("signal"), run a scheduler command
    ("run"), or print a command the user must run elsewhere ("print")."""

    kind: str
    argv: tuple[str, ...] = ()
    pid: int | None = None


@dataclass(frozen=True)
class Detected:
    """The job this process runs in, as its scheduler names it."""

    scheduler: str
    job_id: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


class Scheduler(Protocol):
    name: str
    """What the job record, the run-dir lock and `status` call it."""

    by_pid: bool
    """True when a job is its launcher process on the recorded host (alive = that pid runs); False when
    the scheduler answers for the job (the submitting process may be long gone)."""

    launcher: str
    """The module that owns render and submit (imported by name, on first use: load_launcher)."""

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        """The job of this environment, when it is one of this scheduler's; else None."""

    def state(self, job_id: str, extra: Mapping[str, str]) -> str | None:
        """The scheduler's word for the job, in Slurm's vocabulary (PENDING, RUNNING, COMPLETED, FAILED,
        CANCELLED...: jobs.state.scheduler_word reads it); None when it cannot say."""

    def alive(self, job_id: str) -> bool:
        """Whether the job still owns its run dir (pending, running, requeued); True when it cannot tell."""

    def cancel(self, run_dir: Path, nodes: Sequence[JobRecord]) -> list[Step]:
        """What a clean stop of the launch `nodes` takes; BadInput when the job is not proven this run's."""

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        """The scheduler's own output files for the job (beside RUN_DIR/logs, which every rank writes)."""

    def claim(self, job_id: str, run_dir: Path) -> None:
        """From inside the job, once: bind it to `run_dir` so that `cancel` can prove it (best effort)."""

    def render(self, spec: Any, options: Any) -> str:
        """What `submit` would start for a launcher.spec.JobSpec, as text (the dry run): pure, the same
        text for the same input, no file written, no process started. `options` is the launcher's own
        (local: a NodePlacement; slurm: SlurmOptions; k8s: (K8sOptions, the recipe's text))."""

    def submit(self, argv: Sequence[str]) -> int:
        """Start a job from the launcher's command line (its grammar, checks and pre-spawn policy);
        the launcher's exit code."""


_BACKENDS: dict[str, Scheduler] = {}


def register(backend: Scheduler) -> Scheduler:
    """Add (or replace) a backend; detection asks the newest first, so a specific backend registered
    after the built-in ones is found before the local fallback."""
    _BACKENDS.pop(backend.name, None)
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _BACKENDS.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get(name: str | None) -> Scheduler | None:
    """The backend a record or a lock names; None for a name no backend has (an unknown record)."""
    return _BACKENDS.get(name or "")


def detect(env: Mapping[str, str]) -> Detected:
    """The job this environment belongs to: the newest registered backend that recognises it."""
    for backend in reversed(_BACKENDS.values()):
        found = backend.detect(env)
        if found is not None:
            return found
    return Detected("local")


def load_launcher(module: str) -> Any:
    """A backend's launcher module, imported on first use (render, submit) and not before."""
    return importlib.import_module(module)


def alive(scheduler: str, job_id: str) -> bool:
    """runlock's question: does scheduler job `job_id` still own its run dir? (unknown backend: yes)"""
    backend = get(scheduler)
    return True if backend is None else backend.alive(job_id)


def _register_builtins() -> None:
    from torchlaunch.schedulers import k8s, local, slurm

    for backend in (local.BACKEND, slurm.BACKEND, k8s.BACKEND):
        register(backend)


_register_builtins()
