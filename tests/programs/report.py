"""Helper of the test programs: what this rank saw, as one JSON file per rank (no torch, no torchlaunch.api)."""

from __future__ import annotations

import json
import os
import sys


def record(out_dir: str, **extra: object) -> None:
    rank = os.environ.get("RANK", "0")
    seen = {
        "argv": sys.argv,
        "path0": sys.path[0],
        "rank": rank,
        "world_size": os.environ.get("WORLD_SIZE"),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "master_port": os.environ.get("MASTER_PORT"),
        **extra,
    }
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".rank{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(seen, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
