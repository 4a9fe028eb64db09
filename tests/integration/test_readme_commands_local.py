"""test_readme_commands_local: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_readme_commands.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.test_readme_commands import run_commands


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_commands_run(tmp_path: Path) -> None:
    """The README's own commands (the quick start and the first tasks): in CI's tier."""
    report = run_commands("", tmp_path, [REPO / "README.md"])
    assert sum(line.startswith("ran (README.md") for line in report) >= 8, report


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1800)  # ~40 commands, fast93's 3 steps among them: past pytest's 600 s on a loaded 2-core box
def test_docs_site_commands_run(tmp_path: Path) -> None:
    """Every page's commands, the README's first (later pages build on the runs they leave): ~9 minutes
    on a 2-core box, so in the extended tier (make test-extended), not in CI's."""
    report = run_commands("", tmp_path)
    ran_pages = {line.split("(", 1)[1].split(",", 1)[0] for line in report if line.startswith("ran (")}
    assert len(ran_pages) >= 6, sorted(ran_pages)
