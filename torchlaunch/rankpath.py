"""What a rank's PYTHONPATH gets from the project: a folder holding only `torchlaunch`, never the project root.

A rank must import torchlaunch (the runner, the Slurm task, `torchlaunch.api`) from any working
directory, but the project root also holds `tests`, `bench`, `examples`, `faults`, `configs`: on a
rank's path those shadow a user's own packages of the same name (`import tests` got ours). The
folder rankpath/ beside the package holds one link, `torchlaunch -> ../torchlaunch`, so it puts that
one package on the path and nothing else. The project root is also taken out of an inherited
PYTHONPATH (`PYTHONPATH=. python -m launch.local ...` from the checkout): the ranks get the link instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FOLDER = REPO_ROOT / "rankpath"
"""On a rank's PYTHONPATH: `torchlaunch` and nothing else of the project."""


def checkout(root: str | os.PathLike[str] = REPO_ROOT) -> bool:
    """Whether `root` is the project's checkout (it has rankpath/), not the site-packages of an install."""
    return (Path(root) / FOLDER.name / "torchlaunch").is_dir()


def pythonpath(inherited: str | None, root: str | os.PathLike[str] = REPO_ROOT) -> str:
    """A rank's PYTHONPATH: the launcher's own entries without the project root, then FOLDER (last, so
    a user's own entries win as before). Unchanged where torchlaunch is installed, not a checkout: then
    `root` is site-packages, which is the interpreter's, not the project's."""
    if not checkout(root):
        return inherited or ""
    root_real = os.path.realpath(root)
    kept = [p for p in (inherited or "").split(os.pathsep) if p and os.path.realpath(p) != root_real]
    folder = str(Path(root) / FOLDER.name)
    return os.pathsep.join([*[p for p in kept if p != folder], folder])


def scrub(root: str | os.PathLike[str] = REPO_ROOT) -> None:
    """Take the project root off this process's path before a user's program runs (the runner): an
    inherited PYTHONPATH holding it reaches a rank on every launcher (Slurm exports the submission
    environment). sys.path[0], the program's own folder or working directory, is the user's and kept;
    os.environ too, so the program's own child processes see the same."""
    if not checkout(root):
        return
    root_real = os.path.realpath(root)
    sys.path[1:] = [p for p in sys.path[1:] if not p or os.path.realpath(p) != root_real]
    if "PYTHONPATH" in os.environ:
        os.environ["PYTHONPATH"] = pythonpath(os.environ["PYTHONPATH"], root)
