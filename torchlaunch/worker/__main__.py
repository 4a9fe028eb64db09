"""`python -m train --config PATH [key=value ...]`: run one training rank through the one runner."""

import sys

from torchlaunch import (
    pdeath,
    runner,
    startup,  # noqa: F401 - before any heavy import: its clock fallback (no /proc) starts here
)

pdeath.die_with_agent()  # torchrun starts ranks in sessions of their own: end with it
runner.exit_process(runner.main(["-m", runner.BUILTIN_WORKER, *sys.argv[1:]]))
