"""Print the project's runtime dependencies (pyproject [project].dependencies), one per line, plus
those of each optional extra named after the path (`project_deps.py pyproject.toml live`).

Used by the image build and the wheelhouse script so both install exactly what the package declares,
in a layer that only changes when pyproject.toml or constraints.txt change. The image takes the `live`
extra: the Kubernetes renderings run the membership service (torchft's Lighthouse) from the same image.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib


def project_dependencies(pyproject: Path, extras: list[str] | None = None) -> list[str]:
    with pyproject.open("rb") as f:
        project = tomllib.load(f).get("project", {})
    found = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras or []:
        if extra not in optional:
            sys.exit(f"project_deps: no optional dependencies named {extra!r} in {pyproject}")
        found += [d for d in optional[extra] if d not in found]
    return found


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    if not path.is_file():
        sys.exit(f"project_deps: {path} not found; run from the repository root or pass its path")
    print("\n".join(project_dependencies(path, sys.argv[2:])))
