"""test_data_registry_torch_free: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_data_registry.py.
"""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_launch_side_precheck_imports_neither_torch_nor_the_worker() -> None:
    """A fresh interpreter (this one has torch loaded): the pre-check and the registry it asks load no
    torch and none of the built-in worker's data, trainer or model modules."""
    code = (
        "import json, sys; import torchlaunch.launch.precheck, torchlaunch.data; "
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torchlaunch.worker.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout)
    assert loaded == [], loaded  # fp16-on-CPU's rule is the config's (torchlaunch.trainer_sections.refuse_fp16_on_cpu)
