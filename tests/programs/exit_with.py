"""`exit_with.py CODE OUT_DIR`: record what this rank saw (OUT_DIR/rankR.json), then exit with CODE."""

import sys

from report import record

if __name__ == "__main__":
    record(sys.argv[2], name=__name__)
    sys.exit(int(sys.argv[1]))
