"""What user text may become in a Slurm artefact: `#SBATCH` directives and pyxis' container mounts
(torchlaunch.launch.emit is every launcher's way for the rest: shell words, comments, argv).

- `sbatch_value` / `sbatch_key` / `sbatch_path`: `#SBATCH` directives, which sbatch reads line by line
  before the shell runs: no control characters at all, and paths free of the filename-pattern
  characters `%` (Slurm and submitit expand `%j`, `%x`...) and `\\` (Slurm stops expanding a pattern
  that holds one, so submitit's `%j` log names would never be filled in).
- `container_mount`: a path in pyxis' `--container-mounts`.

Each either carries a value verbatim or refuses it with BadInput, one line naming the value and the fix.
"""

from __future__ import annotations

import re
from typing import Any

from torchlaunch.exit_codes import BadInput
from torchlaunch.launch.emit import PREFIX, refuse_control, shown
from torchlaunch.launch.shape import NodeRange

_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def sbatch_value(value: Any, what: str) -> Any:
    """A `#SBATCH --key=value` value: sbatch reads it line by line, so it must be one printable line.

    Booleans and numbers pass through (submitit renders True as a bare flag)."""
    if isinstance(value, bool | int | float):
        return value
    text = str(value)
    refuse_control(text, what, "sbatch reads each #SBATCH directive as one line: pass a single-line value")
    if not text.strip():
        raise BadInput(f"{PREFIX}{what} is empty; pass a value or leave the option out")
    return value


def sbatch_key(key: str) -> str:
    """An extra `#SBATCH --KEY`: an option name (lowercase letters, digits, '-'), nothing else."""
    name = key.lstrip("-")
    if not _SBATCH_KEY.match(name):
        raise BadInput(
            f"{PREFIX}--sbatch key {shown(key)} is not an sbatch option name "
            f"(lowercase letters, digits, '-'; e.g. --sbatch mail-type=END)"
        )
    return name


def sbatch_path(path: str, what: str) -> str:
    """A path that becomes a Slurm filename pattern (--output, --error, submitit's folder).

    Slurm expands `%j`, `%x`, `%N`... in it (and `%%` to `%`), and submitit substitutes `%j` in the
    same string in Python, so no escaping keeps both readers agreeing: `%` is refused. A backslash
    makes Slurm skip the expansion of the whole pattern (the logs would be named `%j_0_log.out`
    literally), so it is refused too."""
    refuse_control(path, what, "choose a run dir whose name is one printable line")
    for char, why in (("%", "Slurm expands %j, %x... in log paths"), ("\\", "Slurm then expands no %j in log paths")):
        if char in path:
            raise BadInput(f"{PREFIX}{what} {shown(path)} holds {char!r} ({why}); choose a run dir without it")
    return path


def container_mount(path: str, what: str) -> str:
    """A path in pyxis' `--container-mounts SRC:DST[,SRC:DST]`: ':' and ',' would split it."""
    refuse_control(path, what, "choose a path whose name is one printable line")
    for char in (":", ","):
        if char in path:
            raise BadInput(
                f"{PREFIX}{what} {shown(path)} holds {char!r}, which splits pyxis' --container-mounts; "
                f"choose a path without it"
            )
    return path


def sbatch_nodes(nodes: NodeRange) -> str:
    """sbatch's --nodes value (Slurm's own range spelling)."""
    return f"{nodes.min}-{nodes.max}" if nodes.elastic else str(nodes.max)
