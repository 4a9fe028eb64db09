"""`crash_once.py MARKER_DIR`: rank 0 crashes on its first run and every rank finishes on the next
(a marker file remembers the first run), to exercise torchrun restarts."""

import os
import sys

if __name__ == "__main__":
    marker = os.path.join(sys.argv[1], "crashed")
    if os.environ.get("RANK", "0") == "0" and not os.path.exists(marker):
        os.makedirs(sys.argv[1], exist_ok=True)
        open(marker, "w").close()
        raise RuntimeError("first attempt crashes on purpose")
    print(f"rank {os.environ.get('RANK')} finished after restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
