"""A user's project whose own package is called `train` (`python -m train.main --out OUT`).

This package runs first in every rank (`-m train.main` imports the package before its module): its first statement
records what the process had imported before any of this project's code ran."""

import sys

AT_START = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
"""Every module this process had imported before this project's first line: name -> file."""
