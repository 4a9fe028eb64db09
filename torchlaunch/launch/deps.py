"""The project's Python dependencies, checked where a command a user types starts (launch/*.py, train/*.py).

Why: run by a Python without them (the system's `python`, not .venv's), `launch.local` started its
ranks, which died on `import torch` (exit 1, "retry per policy": a scheduler would retry it forever),
left a failed record in the run dir, and `launch status` or `train.shards --help` printed a traceback.
Missing packages are bad input of the environment: one line naming the fix, exit 2, before anything
runs or is written. Standard library only: this module must import where nothing else does.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec

from torchlaunch.exit_codes import BAD_INPUT

PACKAGES = {
    "torch": "torch",
    "torchvision": "torchvision",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "submitit": "submitit",
    "tqdm": "tqdm",
    "xxhash": "xxhash",
    "torchft": "torchft",
}
"""Import name -> distribution, pyproject.toml's `dependencies` (a unit test keeps the two the same)."""
TRAINING = tuple(name for name in PACKAGES if name not in ("submitit", "torchft"))
"""What a rank of the built-in worker or of a user's program imports (launch.local starts them); torchft
only in live mode, checked where it is chosen (require_live_extra)."""
SUBMIT = ("yaml", "submitit")
"""launch.slurm on this host: the ranks' packages are the nodes' (a pyxis container's image may hold
them where the login node has none); one missing at submission is still the one line (run_module)."""
RENDER = ("yaml",)
"""launch.k8s: renders manifests; the pods run the image's Python."""

Find = Callable[[str], "ModuleSpec | None"]


def missing(names: Sequence[str], find: Find = importlib.util.find_spec) -> list[str]:
    """The distributions of `names` this interpreter cannot import (found, not imported: milliseconds)."""
    return [PACKAGES.get(name, name) for name in names if find(name) is None]


def advice(lacking: Sequence[str], command: str) -> str:
    """The one line for a Python without the project's packages."""
    return (
        f"env error: this Python ({sys.executable}) lacks {', '.join(lacking)}, which {command} needs: run it "
        f"with the project's environment, `.venv/bin/python -m {command} ...` or `source .venv/bin/activate` "
        "first (`make install` creates .venv)"
    )


def run_module(module: str, command: str, needs: Sequence[str] = ()) -> None:
    """Run `module` as `python -m COMMAND` would (the entry point's whole job), once `needs` are found;
    a dependency of the project missing on the way (an import inside the command) is the same one line."""
    lacking = missing(needs)
    if lacking:
        print(advice(lacking, command), file=sys.stderr, flush=True)
        raise SystemExit(BAD_INPUT)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except ModuleNotFoundError as problem:
        top = (problem.name or "").partition(".")[0]
        if top not in PACKAGES:
            raise
        print(advice([PACKAGES[top]], command), file=sys.stderr, flush=True)
        raise SystemExit(BAD_INPUT) from None
