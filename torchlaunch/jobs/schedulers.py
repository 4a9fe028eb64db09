"""The one registry of schedulers a job can run under, and what the job's handle asks of them.

Why here, on the jobs floor: the job record, the run-dir lock, `--wait` and `python -m launch
status|logs|cancel|list` ask a job's scheduler through `get(name)` and never branch on its name, and
every backend package (torchlaunch/backends/: local/, slurm/, k8s/) writes that job record. The
interface both sides meet on (Backend, JobState, Step, Detected, LaunchRecord) and the lookup therefore
sit below the backends: the backends import it (re-exported as `torchlaunch.backends`), this module
imports no backend.

A backend owns everything its scheduler means to the project, in three parts: the launch side (a pure
render of a JobSpec into an argv, an sbatch script or manifests, and `submit`), the operate side (how
to find a job from inside it: `detect`; what the scheduler says about it: `state`, `alive`; how to stop
it: `cancel`; its own output files: `logs`; how a job proves it belongs to a run dir: `claim`) and, where
the scheduler runs our code itself, the in-task side (Slurm's task).

The registry is the built-in table BUILTIN plus the `torchlaunch.backends` entry-point group, as
TorchX finds its schedulers: a third-party backend is a package that declares

    [project.entry-points."torchlaunch.backends"]
    mine = "my_package.backend:BACKEND"

(tests/unit/test_seams.py registers one, "a subprocess on this host", and operates it end to end).
Both are `module:attribute` lines loaded by name on the first question (as the data registry names its
readers), so this module stays below the packages it finds. A scheduler's states reach the project as
a JobState in the project's own words (WORDS); each backend translates its scheduler's vocabulary.
Launch modules are imported on first use only (`load_launcher`): the operator commands load the
registry without torch. Stdlib only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


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


WORDS = ("pending", "requeued", "running", "finished", "cancelled", "failed", "preempted")
"""The project's words for a job's state as its scheduler reports it (jobs.state decides with them)."""


@dataclass(frozen=True)
class JobState:
    """What a scheduler says of a job: `word`, one of WORDS; `said`, its own text, quoted to the user."""

    word: str
    said: str
    note: str = ""
    """What the backend adds that an operator should know beside the state (`status` prints it as a
    note): e.g. a live Slurm job's successor waiting in the queue behind it."""

    def __post_init__(self) -> None:
        if self.word not in WORDS:
            raise ValueError(f"job state {self.word!r} is not one of {WORDS}")


class LaunchRecord(Protocol):
    """What a backend reads of one node's launch record (torchlaunch.jobs.record.JobRecord)."""

    node_rank: int
    host: str | None
    job_id: str | None
    launcher_pid: int | None
    outcome: str | None
    extra: dict[str, str]

    def launcher_alive(self) -> bool: ...


class Backend(Protocol):
    name: str
    """What the job record, the run-dir lock and `status` call it."""

    by_pid: bool
    """True when a job is its launcher process on the recorded host (alive = that pid runs); False when
    the scheduler answers for the job (the submitting process may be long gone)."""

    launcher: str
    """The module that owns render and submit (imported by name, on first use: load_launcher)."""

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        """The job of this environment, when it is one of this scheduler's; else None."""

    def state(self, job_id: str, extra: Mapping[str, str]) -> JobState | None:
        """What the scheduler says of the job, in the project's words; None when it cannot say."""

    def alive(self, job_id: str) -> bool:
        """Whether the job still owns its run dir (pending, running, requeued); True when it cannot tell."""

    def cancel(self, run_dir: Path, nodes: Sequence[LaunchRecord]) -> list[Step]:
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


_BACKENDS: dict[str, Backend] = {}
_LOADED = False
"""Whether the built-in and installed backends were registered (on the first question, `_load_all`)."""


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; detection asks the newest first, so a specific backend registered
    after the built-in ones is found before the local fallback."""
    _load_all()
    _add(backend)
    return backend


def unregister(name: str) -> None:
    _load_all()
    _BACKENDS.pop(name, None)


def names() -> tuple[str, ...]:
    _load_all()
    return tuple(_BACKENDS)


def get(name: str | None) -> Backend | None:
    """The backend a record or a lock names; None for a name no backend has (an unknown record)."""
    _load_all()
    return _BACKENDS.get(name or "")


def detect(env: Mapping[str, str]) -> Detected:
    """The job this environment belongs to: the newest registered backend that recognises it."""
    _load_all()
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


BUILTIN = (
    "torchlaunch.backends.local.operate:BACKEND",
    "torchlaunch.backends.slurm.operate:BACKEND",
    "torchlaunch.backends.k8s.operate:BACKEND",
)
"""The backends this package ships, one line each; the local fallback first (detection asks the newest first)."""

ENTRY_POINT_GROUP = "torchlaunch.backends"


def load(target: str) -> Backend:
    """The backend object a "module:attribute" line names."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def entry_point_targets() -> list[str]:
    """The "module:attribute" of every installed package's backend (the entry-point group), by name."""
    from importlib.metadata import entry_points

    return [ep.value for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)]


def _load_all() -> None:
    """Once, before the first answer: the built-in backends, then the installed packages' ones. A broken
    third-party entry point is skipped with one line on stderr: it must not take `status` or a launch of
    a built-in backend down. The flag is set first: a backend module that asks the registry while it is
    being loaded gets the backends loaded so far, not a second round."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for target in BUILTIN:
        _add(load(target))
    for target in entry_point_targets():
        if target in BUILTIN:
            continue
        try:
            _add(load(target))
        except Exception as e:  # noqa: BLE001 - someone else's package: say it and go on
            print(f"torchlaunch: backend {target!r} not loaded: {type(e).__name__}: {e}"[:300], file=sys.stderr)


def _add(backend: Backend) -> None:
    _BACKENDS.pop(backend.name, None)
    _BACKENDS[backend.name] = backend
