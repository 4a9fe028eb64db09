"""`python -m train --config PATH [key=value ...]`: run one training rank through the one runner."""

import sys

from torchlaunch import (
    runner,
    startup,  # noqa: F401 - before any heavy import: its clock fallback (no /proc) starts here
)

runner.exit_process(runner.main(["-m", runner.BUILTIN_WORKER, *sys.argv[1:]]))
