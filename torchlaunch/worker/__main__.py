"""`python -m train --config PATH [key=value ...]`: run one training rank."""

import os
import sys

from torchlaunch import startup  # noqa: F401 - first: its clock fallback (no /proc) starts at import
from torchlaunch.worker.run import main

code = main()
# Leave without interpreter teardown: with several gloo ranks, C++ threads still winding down at
# finalisation sometimes abort the process ("terminate called without an active exception") after a
# clean finish, turning exit 0 into a crash. Everything worth keeping is flushed and fsynced by now.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
