"""test_jpeg_decode_import: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_jpeg_decode.py.
"""

from __future__ import annotations

import pytest

from torchlaunch.worker.data import jpeg

pytestmark = pytest.mark.skipif(jpeg.decoder() is None, reason="torchvision without its JPEG decoder")


def test_the_decoder_loads_without_importing_torchvision() -> None:
    """`import torchvision` costs seconds (its models pull in torch._dynamo) in every DataLoader
    worker and in the first-batch budget: the tensor decode loads only the image extension."""
    import subprocess
    import sys

    code = (
        "import sys; from torchlaunch.worker.data import jpeg; from torchlaunch.worker.data.boxes import decode_box; "
        "assert jpeg.decoder() is not None; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
