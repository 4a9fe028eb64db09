"""Helper of the test programs: what this rank saw, as one JSON file per rank (no torch, no torchlaunch.api)."""

from __future__ import annotations

import json
import os
import sys

PROJECT = ("tests", "bench", "examples", "faults", "configs", "torchlaunch")
"""The project's top-level folders: only torchlaunch may be importable in a user's rank."""


def importable() -> dict[str, str | None]:
    """Where each of the project's top-level names would be imported from (None: not importable)."""
    import importlib.util

    found = {}
    for name in PROJECT:
        spec = importlib.util.find_spec(name)
        found[name] = None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))
    return found


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
