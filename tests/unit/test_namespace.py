"""test_namespace: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_namespace_fresh_interpreters.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO
from tests.integration.test_namespace_fresh_interpreters import OURS, PACKAGE, top_level_imports


def test_top_level_imports_sees_every_form(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, train.x\nfrom launch import y\nfrom . import z\nimport importlib\n"
        "importlib.import_module('utils.a')\nrunpy.run_module('models')\n"
    )
    assert top_level_imports(probe) == [
        (1, "os"),
        (1, "train"),
        (2, "launch"),
        (4, "importlib"),
        (5, "utils"),
        (6, "models"),
    ]


def test_no_module_under_torchlaunch_imports_a_top_level_name_a_user_could_own() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30  # the whole package, not an empty glob
    offending = [
        f"{path.relative_to(REPO)}:{line}: imports {name}"
        for path in files
        for line, name in top_level_imports(path)
        if name in OURS
    ]
    assert offending == []


def test_thin_command_modules_only_hand_over_to_torchlaunch() -> None:
    """train/ and launch/ at the top level run torchlaunch's modules and import nothing of each other."""
    for path in sorted([*(REPO / "train").glob("*.py"), *(REPO / "launch").glob("*.py")]):
        names = {name for _, name in top_level_imports(path)}
        assert names <= {"runpy", "torchlaunch", "__future__"}, f"{path.relative_to(REPO)} imports {names}"
