"""A pytest session's library of finished (or preempted) run dirs: each built once, by the first test
that asks for it, and read by every test after it.

Several tests start the very same launch only to read what it left (a reference run's weights and
batch traces, a run stopped at a known step); each launch costs seconds to minutes of CPU. The
library starts each recipe at most once per session (per xdist worker):

    def test_x(run_library: RunLibrary, tmp_path: Path) -> None:
        reference = run_library.path("resume")  # read only: never write into it
        preempted = run_library.copy("checkpoint-preempted", tmp_path)  # a private copy, to resume into

Rules: a test that only reads uses `path`/`result`; a test that writes into a run dir (resumes into it,
plants files, deletes its model.pt) takes `copy`, so no test sees another's changes. Every later ask
checks the shared folder is still as built (names, sizes, mtimes) and fails naming what changed. A
recipe that fails is not started again: every later asker fails with the first failure's message. The
recipes stay in the test modules that own them, imported only when built (collecting builds nothing).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Built:
    """A run dir the library built and the launch that wrote it (exit code, stdout, stderr)."""

    path: Path
    result: subprocess.CompletedProcess
    files: dict[str, tuple[int, int]]
    """relative path -> (size, mtime_ns) of every file as built: a reader that wrote into it is caught."""


def fingerprint(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and link under root (not followed): relative path -> (size, mtime_ns)."""
    found: dict[str, tuple[int, int]] = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_dir():
            st = path.lstat()
            found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


def _resume(run_dir: Path) -> subprocess.CompletedProcess:
    """The uninterrupted 2-rank run of test_resume.SMALL (48 steps, batch traces): the reference of
    tests/integration/test_resume.py and test_preempt_last_step.py."""
    from tests.integration.test_resume import run

    done = run(run_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _elastic(run_dir: Path) -> subprocess.CompletedProcess:
    """The uninterrupted one-rank run of test_elastic_local.RECIPE (batch traces): the samples every
    elastic test compares with (tests/integration/test_elastic_local.py, tests/engines/test_elastic_slurm.py)."""
    from tests.helpers import launcher
    from tests.integration.test_elastic_local import DEADLINE_S, RECIPE

    done = launcher(["--device", "cpu", *RECIPE, f"run_dir={run_dir}"], timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _checkpoint_preempted(run_dir: Path) -> subprocess.CompletedProcess:
    """2 ranks of test_checkpoint_runs.SMALL preempted by rank 1's fault at step 3: exit 75 with the
    agreed step's checkpoint committed (each parametrization of its hostile-folders test resumes a copy)."""
    from tests.integration.test_checkpoint_runs import two_ranks

    first = two_ranks(run_dir, "at=step,n=3,rank=1")
    assert first.returncode == 75, first.stderr[-2000:]
    return first


def _live_long(run_dir: Path) -> subprocess.CompletedProcess:
    """The uninterrupted live run of bench/live.py's recipe over 48 epochs of 64 steps (batch traces):
    the reference of the rejoin tests of tests/integration/test_live_recovery.py, long enough that a
    rank started again joins well before the end."""
    from bench import live

    done = live.run(run_dir, victim=None, steps=64, epochs=LIVE_LONG_EPOCHS)
    assert done.code == 0, done.stderr[-3000:]
    return subprocess.CompletedProcess(["launch.local", str(run_dir)], done.code, done.stderr, "")


def _live(run_dir: Path) -> subprocess.CompletedProcess:
    """The uninterrupted live run of bench/live.py's recipe (2 ranks, nothing killed, batch traces):
    the plan every live test compares with (tests/integration/test_live_recovery.py,
    tests/engines/test_live_slurm.py; the plan does not depend on the launcher or the world)."""
    from bench import live

    done = live.run(run_dir, victim=None)
    assert done.code == 0, done.stderr[-3000:]
    return subprocess.CompletedProcess(["launch.local", str(run_dir)], done.code, "", done.stderr)


LIVE_LONG_EPOCHS = 48
SURVIVOR_SHARE = 0.2
"""The CPU share the rejoin tests leave the survivors from the loss until the rank started again has
joined (bench.slow_node): ~3,000 survivor steps take ~5 s on a fast box, about the time of two rank
start-ups; at a fifth of the CPU they take ~25 s, whatever the box, and the joiner is in well before."""

RECIPES: dict[str, Callable[[Path], subprocess.CompletedProcess]] = {
    "resume": _resume,
    "elastic": _elastic,
    "checkpoint-preempted": _checkpoint_preempted,
    "live": _live,
    "live-long": _live_long,
}
"""name -> builder(run_dir): starts the launch into run_dir (an empty folder), asserts its exit code."""


class RunLibrary:
    """The session's run dirs, built lazily (RECIPES); one instance per session (tests/conftest.py)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._built: dict[str, Built] = {}
        self._failed: dict[str, str] = {}

    def get(self, name: str) -> Built:
        """The built entry (its launch run on the first ask). Read only: see `copy` for writers."""
        if name in self._built:
            built = self._built[name]
            now = fingerprint(built.path)
            changed = sorted(k for k in built.files.keys() | now.keys() if built.files.get(k) != now.get(k))
            assert not changed, f"library run {name!r} was written to by a reader (take `copy`): {changed[:10]}"
            return built
        if name in self._failed:
            pytest.fail(
                f"library run {name!r} failed earlier in this session, not started again:\n{self._failed[name]}"
            )
        builder = RECIPES[name]
        run_dir = self._factory.mktemp(f"library-{name}")
        try:
            result = builder(run_dir)
        except (Exception, pytest.fail.Exception) as e:  # an assertion, a timeout's pytest.fail: remembered
            self._failed[name] = f"{type(e).__name__}: {e}"
            raise
        self._built[name] = Built(run_dir, result, fingerprint(run_dir))
        return self._built[name]

    def path(self, name: str) -> Path:
        """The shared run dir, to read only."""
        return self.get(name).path

    def result(self, name: str) -> subprocess.CompletedProcess:
        """The launch that built it: exit code, stdout, stderr."""
        return self.get(name).result

    def copy(self, name: str, dest: Path) -> Built:
        """A private copy of the entry at `dest` (which may exist, empty), for a test that writes to it;
        the launch's result comes with it. Symlinks are copied as symlinks, never followed."""
        built = self.get(name)
        shutil.copytree(built.path, dest, symlinks=True, dirs_exist_ok=True)
        return Built(dest, built.result, fingerprint(dest))
