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
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torchlaunch.base import bounded
from torchlaunch.exit_codes import BadInput


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
_BUILTIN_NAMES: set[str] = set()
_LOADED = False
"""Whether the built-in and installed backends were registered (on the first question, `_load_all`)."""


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; detection asks the newest first, so a specific backend registered
    after the built-in ones is found before the local fallback. A built-in backend's name is refused
    (ValueError): the job records and locks of every run name them, and a replacement would operate
    those runs' jobs by rules nobody chose."""
    _load_all()
    if backend.name in _BUILTIN_NAMES and _BACKENDS.get(backend.name) is not backend:
        raise ValueError(f"backend {backend.name!r} is built in and cannot be replaced")
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


PLUGIN_TIMEOUT_S = 10.0
"""The longest a third-party backend's import, or one call of its hooks, may take (base.bounded): `status`
answers in about a second, and a scheduler's own query tools time out well within this."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _warn(text: str) -> None:
    print(f"torchlaunch: {text}"[:300], file=sys.stderr, flush=True)


class Guarded:
    """A third-party backend behind a time bound and an error fence (issue 52: one whose detect() raised
    crashed launch.local, one whose hook hung hung `status`). What only reports (detect, state, alive,
    logs, claim) turns a failure, a hang or an answer of the wrong type into one warning line and the
    answer of a scheduler that cannot say; what the user asked of it by name (cancel, render, submit)
    turns it into BadInput, one line naming the backend (exit 2)."""

    def __init__(self, backend: Backend, target: str) -> None:
        self._backend, self._target = backend, target
        self.name = str(backend.name)
        self.by_pid = backend.by_pid is True
        self.launcher = str(backend.launcher)

    def _run(self, hook: str, *args: Any) -> Any:
        return bounded.call(lambda: getattr(self._backend, hook)(*args), PLUGIN_TIMEOUT_S, f"{self.name}.{hook}")

    def _soft(self, hook: str, fallback: Any, kinds: tuple[type, ...], *args: Any) -> Any:
        try:
            said = self._run(hook, *args)
        except bounded.Failed as e:
            _warn(f"backend {self.name!r} ({self._target}) {hook}() {e}: ignored")
            return fallback
        if not isinstance(said, kinds):
            _warn(f"backend {self.name!r} ({self._target}) {hook}() returned a {type(said).__name__}: ignored")
            return fallback
        return said

    def _hard(self, hook: str, *args: Any) -> Any:
        try:
            return self._run(hook, *args)
        except bounded.Failed as e:
            raise BadInput(f"launch error: backend {self.name!r} ({self._target}) {hook}() {e}"[:400]) from None

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        found = self._soft("detect", None, (Detected, type(None)), env)
        return found if found is None or found.scheduler == self.name else None  # its own jobs only

    def state(self, job_id: str, extra: Mapping[str, str]) -> JobState | None:
        return self._soft("state", None, (JobState, type(None)), job_id, extra)

    def alive(self, job_id: str) -> bool:
        return self._soft("alive", True, (bool,), job_id)

    def cancel(self, run_dir: Path, nodes: Sequence[LaunchRecord]) -> list[Step]:
        steps = self._hard("cancel", run_dir, nodes)
        if not isinstance(steps, list) or not all(isinstance(step, Step) for step in steps):
            raise BadInput(f"launch error: backend {self.name!r} ({self._target}) cancel() returned no list of steps")
        return steps

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        found = self._soft("logs", [], (list,), run_dir, job_id)
        return [p for p in found if isinstance(p, Path)]

    def claim(self, job_id: str, run_dir: Path) -> None:
        self._soft("claim", None, (object,), job_id, run_dir)

    def render(self, spec: Any, options: Any) -> str:
        return str(self._hard("render", spec, options))

    def submit(self, argv: Sequence[str]) -> int:
        """Not time-bounded (a submission may follow its job to the end), only fenced."""
        try:
            return int(self._backend.submit(argv))
        except (BadInput, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit from a plug-in is a failure, not our exit
            raise BadInput(
                f"launch error: backend {self.name!r} ({self._target}) submit() raised {bounded.describe(e)}"[:400]
            ) from None


def load_plugin(target: str, taken: set[str]) -> Guarded | None:
    """An installed package's backend, imported within PLUGIN_TIMEOUT_S and behind Guarded; None, with one
    line on stderr, when it fails, hangs, is not a backend, or takes a built-in backend's name (`taken`: a
    package can add a scheduler, never replace slurm, local or k8s under a run's feet)."""
    try:
        guarded = bounded.call(lambda: Guarded(load(target), target), PLUGIN_TIMEOUT_S, target)
    except bounded.Failed as e:
        _warn(f"backend {target!r} not loaded: its import {e}")
        return None
    if not NAME.fullmatch(guarded.name):
        _warn(f"backend {target!r} not loaded: its name {guarded.name[:40]!r} is not a scheduler's name")
        return None
    if guarded.name in taken:
        _warn(f"backend {target!r} not loaded: {guarded.name!r} is a built-in backend's name, which it cannot replace")
        return None
    return guarded


def _load_all() -> None:
    """Once, before the first answer: the built-in backends, then the installed packages' ones. A broken,
    hanging or impostor third-party entry point is skipped with one line on stderr (load_plugin): it must
    not take `status` or a launch of a built-in backend down. The flag is set first: a backend module that
    asks the registry while it is being loaded gets the backends loaded so far, not a second round."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for target in BUILTIN:
        _add(load(target))
    _BUILTIN_NAMES.update(_BACKENDS)
    for target in entry_point_targets():
        if target in BUILTIN:
            continue
        found = load_plugin(target, _BUILTIN_NAMES)
        if found is not None:
            _add(found)


def _add(backend: Backend) -> None:
    _BACKENDS.pop(backend.name, None)
    _BACKENDS[backend.name] = backend
