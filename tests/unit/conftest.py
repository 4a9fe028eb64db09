"""The unit floor: every test here runs in the pytest process alone, so the floor holds by itself.

A test that starts a process (torchrun, a loader worker, a subprocess), forms a process group or opens
a network socket, in its body or in a fixture it sets up, fails naming what it started: it belongs in
tests/integration. What counts is in tests/isolation.py.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from tests import isolation


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build matplotlib's font cache, when matplotlib is installed, before any test is watched.

    On a machine with no cache yet (a fresh CI box), the first `import matplotlib.font_manager` runs
    `fc-list` to list the system fonts: an environment's one-time set-up, not the plot test starting a
    process, and it would fail whichever test imported matplotlib first."""
    try:
        import matplotlib.font_manager  # noqa: F401 - importing it builds and saves the cache
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def in_stage(session_stage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unit test runs in the stage (tests/workdir.py): the checkout's files, but a recipe's default
    run dir (runs/smoke) is the session's, never the one the README's quick start left for the user."""
    monkeypatch.chdir(session_stage)


def _watched(item: pytest.Item, phase: str) -> Generator[None, object, object]:
    started: set[str] = set()
    with isolation.watch(started):
        result = yield
    if started:
        raise isolation.Escaped(
            f"{item.nodeid} ({phase}) {', '.join(sorted(started))}: a unit test runs in-process only; "
            "move it to tests/integration (tests/isolation.py)"
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watched(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watched(item, "call"))
