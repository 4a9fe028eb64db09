"""test_readme_commands_slurm: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/unit/test_readme_commands.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.unit.test_readme_commands import run_commands


@pytest.mark.slow
@pytest.mark.slurm
def test_readme_slurm_commands_run_on_the_local_cluster(tmp_path: Path) -> None:
    if shutil.which("sbatch") is None or not Path(os.environ.get("SLURM_DEV_DIR", "/tmp/slurm-dev")).is_dir():
        pytest.skip("the local Slurm cluster is not set up here (CI: .ci/services.sh up)")
    run_commands("slurm", tmp_path)
