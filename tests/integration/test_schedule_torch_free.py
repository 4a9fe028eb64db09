"""test_schedule_torch_free: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_schedule.py.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_schedule_imports_without_torch() -> None:
    probe = "import sys, torchlaunch.worker.schedule; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
