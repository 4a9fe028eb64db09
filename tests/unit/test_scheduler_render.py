"""test_scheduler_render: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_scheduler_render_imports.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_scheduler_render_imports import render_purely, specs


@pytest.mark.parametrize("name", ["local", "slurm", "k8s"])
def test_render_is_pure_and_is_the_launchers_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    spec, options, launchers_own = specs(tmp_path)[name]
    first, second = render_purely(monkeypatch, tmp_path, name, spec, options)
    assert first == second and first
    expected = launchers_own()
    if name == "local":
        assert first.split() == expected.split()  # shlex.join quotes nothing in this argv
    else:
        assert first == expected
