"""test_slurm_wiring: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_slurm_wiring.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.unit.test_slurm_wiring import (
    HOSTILE,
    call,
    submit_dir,  # noqa: F401 (fixtures, used by name)
)
from torchlaunch.exit_codes import OK


def test_a_hostile_argument_runs_nothing_in_the_sbatch_script(submit_dir: Path, tmp_path: Path) -> None:
    code, script, err = call(["--dry-run", "--run-dir", str(tmp_path / "run"), "--", "script.py", HOSTILE])
    assert code == OK, err
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text("#!/bin/sh\nexit 0\n")
    (stub / "srun").chmod(0o755)
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], timeout=60).returncode == 0
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    assert subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, timeout=60).returncode == 0
    assert not (submit_dir / "F").exists() and not (tmp_path / "F").exists()
    assert "x\\ntouch F #" in script
