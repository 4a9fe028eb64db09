"""test_boundary_local: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_local_launch_boundaries.py.
"""

from __future__ import annotations

from tests.integration.test_local_launch_boundaries import call
from torchlaunch.exit_codes import BAD_INPUT


def test_local_refuses_a_nul_in_a_program_argument(tmp_path):
    from torchlaunch.agent import node

    (tmp_path / "s.py").write_text("")
    code, out, err = call(node.main, ["--dry-run", "--", str(tmp_path / "s.py"), "a\0b"])
    assert code == BAD_INPUT and out == "" and len(err.strip().splitlines()) == 1
    assert "holds a NUL character" in err
