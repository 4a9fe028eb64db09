"""`wait_for_term.py OUT_DIR`: its own SIGTERM handler sets a flag; once the flag is seen the rank
exits 75 (as a script that checkpointed would). Writes OUT_DIR/rankR.json when the handler is in
place, so a test knows when to signal; gives up with exit 1 after 120 s."""

import signal
import sys
import time

from report import record

stop = {"signal": None}


def on_term(signum: int, frame: object) -> None:
    stop["signal"] = signum


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_term)
    record(sys.argv[1])
    deadline = time.monotonic() + 120
    while stop["signal"] is None and time.monotonic() < deadline:
        time.sleep(0.02)  # a training step would be here
    sys.exit(75 if stop["signal"] == signal.SIGTERM else 1)
