"""The suite's floors hold tests by subject: a test module's name says its subject on its floor, so one
name on two floors (tests/unit/test_x.py beside tests/integration/test_x.py) would be one subject split
by how it runs. A file on the integration or engines floor is named after what it proves there."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FLOORS = ("unit", "integration", "engines")


def floors_by_name(tests: Path = TESTS) -> dict[str, list[str]]:
    """Each test module's file name -> the floors (tests/<floor>/, sub-folders included) that hold it."""
    found: dict[str, list[str]] = defaultdict(list)
    for floor in FLOORS:
        for path in sorted((tests / floor).rglob("test_*.py")):
            found[path.name].append(floor)
    return dict(found)


def test_no_test_module_name_sits_on_two_floors() -> None:
    twice = {name: floors for name, floors in floors_by_name().items() if len(floors) > 1}
    assert not twice, f"one name on two floors (name each file after what it proves on its floor): {twice}"


def test_the_check_sees_a_name_on_two_floors(tmp_path: Path) -> None:
    for floor in FLOORS:
        (tmp_path / floor / "sub").mkdir(parents=True)
    (tmp_path / "unit" / "test_x.py").write_text("")
    (tmp_path / "engines" / "sub" / "test_x.py").write_text("")
    (tmp_path / "integration" / "test_y.py").write_text("")
    assert floors_by_name(tmp_path) == {"test_x.py": ["unit", "engines"], "test_y.py": ["integration"]}
