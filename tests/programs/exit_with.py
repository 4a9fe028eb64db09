"""`exit_with.py CODE OUT_DIR`: record what this rank saw, then exit with CODE (rank 0 only when a
third argument `rank0` is given; the other ranks exit 0)."""

import sys

from report import record

if __name__ == "__main__":
    code, out_dir = int(sys.argv[1]), sys.argv[2]
    record(out_dir, name=__name__)
    only_rank0 = sys.argv[3:] == ["rank0"]
    import os

    sys.exit(code if not only_rank0 or os.environ.get("RANK", "0") == "0" else 0)
