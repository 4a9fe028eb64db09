"""`python -m userpkg.main CODE OUT_DIR`: records what it saw, exits CODE."""

import json
import os
import sys

from report import importable  # tests/programs/report.py: the working directory is on the path

if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    os.makedirs(sys.argv[2], exist_ok=True)
    with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "argv": sys.argv,
                "path0": sys.path[0],
                "name": __name__,
                "cwd": os.getcwd(),
                "world_size": os.environ.get("WORLD_SIZE"),
                "importable": importable(),
            },
            f,
        )
    sys.exit(int(sys.argv[1]))
