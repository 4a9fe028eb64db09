"""test_newcomer_slurm_conf: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/integration/test_newcomer_before_spawn.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv


@pytest.mark.slurm
def test_missing_slurm_conf_is_one_line_with_the_fix(tmp_path: Path) -> None:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        pytest.skip("no Slurm client tools here")
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this host has a default slurm.conf, so sbatch finds a configuration without SLURM_CONF")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    r = subprocess.run(
        launcher_argv(
            "torchlaunch.backends.slurm.launch",
            "--nodes",
            "2",
            "--tasks-per-node",
            "1",
            "--config",
            "configs/smoke.yaml",
            f"run_dir={tmp_path}",
        ),
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert 'eval "$(slurm/dev-cluster.sh env)"' in lines[0] and "SLURM_CONF=" in lines[0]
