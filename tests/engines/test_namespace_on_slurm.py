"""test_namespace_on_slurm: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/integration/test_namespace_fresh_interpreters.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.engines.test_slurm_cluster import cluster  # noqa: F401 - the dev cluster fixture
from tests.integration.test_namespace_fresh_interpreters import PROJECTS, assert_user_world, records, user_project


@pytest.mark.slurm
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("cluster")
@pytest.mark.parametrize("kind", sorted(PROJECTS))
def test_user_project_from_its_own_folder_on_slurm(kind: str, tmp_path: Path) -> None:
    from tests.unit.test_user_programs import finish, launcher_text, one_task_per_node, slurm_launch

    project, out, run_dir = user_project(kind, tmp_path), tmp_path / "out", tmp_path / "run"
    proc = slurm_launch(
        run_dir,
        [*PROJECTS[kind][0], "--out", str(out)],
        *one_task_per_node(2, 10),
        cwd=project,
    )
    assert finish(proc, run_dir, 240) == 0, launcher_text(run_dir)[-3000:]
    assert_user_world(records(out), kind, str(project), (str(REPO) + os.sep,))
