"""test_bad_inputs: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_bad_inputs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_bad_inputs import SMOKE, assert_bad_input


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a visible CUDA GPU (the check compares against it)")
def test_more_gpus_than_available(tmp_path: Path) -> None:
    """The CPU-only twin of this test is test_local_launcher.py::test_more_gpus_than_visible."""
    visible = torch.cuda.device_count()
    assert_bad_input(
        ["--gpus", str(visible + 1), "--config", SMOKE, f"run_dir={tmp_path}"],
        f"GPUS={visible + 1} but only {visible} GPU(s) are visible",
    )
