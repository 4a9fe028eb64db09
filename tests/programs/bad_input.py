"""`bad_input.py [RUNS_FILE]`: raises the project's BadInput, as a script that found a bad argument
would; appends one line per run to RUNS_FILE, so a test can count how often it was started."""

import os
import sys

from torchlaunch.exit_codes import BadInput

if len(sys.argv) > 1:
    with open(sys.argv[1], "a") as runs:
        runs.write(f"rank {os.environ.get('RANK', '0')} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}\n")
raise BadInput("data error: --data /nonexistent.csv: no such file (pass an existing CSV)")
