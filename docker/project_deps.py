"""Print the project's runtime dependencies (pyproject [project].dependencies), one per line.

Used by the image build and the wheelhouse script so both install exactly what the package declares,
in a layer that only changes when pyproject.toml or constraints.txt change.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib


def project_dependencies(pyproject: Path) -> list[str]:
    with pyproject.open("rb") as f:
        return list(tomllib.load(f).get("project", {}).get("dependencies", []))


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    if not path.is_file():
        sys.exit(f"project_deps: {path} not found; run from the repository root or pass its path")
    print("\n".join(project_dependencies(path)))
