"""The only way user text reaches a generated artefact: sbatch scripts, manifests, argv lists, pod commands.

Each emitter either carries a value verbatim (quoted for its target) or refuses it with BadInput, one
line naming the value and the fix. Nothing here formats user text into a script by hand:

- `shell_word` / `shell_words`: a POSIX shell word. Single quotes make every byte but NUL data, a
  newline included, so only NUL (which no argv can carry) is refused.
- `comment`: a `#` line. A newline ends a shell or YAML comment, so line breaks and every other
  control or format character are escaped (`\\n`, `\\x1b`, `\\u2028`), never passed through.
- `sbatch_value` / `sbatch_key` / `sbatch_path`: `#SBATCH` directives, which sbatch reads line by line
  before the shell runs: no control characters at all, and paths free of the filename-pattern
  characters `%` (Slurm and submitit expand `%j`, `%x`...) and `\\` (Slurm stops expanding a pattern
  that holds one, so submitit's `%j` log names would never be filled in).
- `argv_item` / `argv_items`: an exec argv element (torchrun, the single worker): verbatim, NUL refused.
- `to_yaml`: YAML only through PyYAML's safe emitter, header lines only through `comment`.

Torch-free and scheduler-free, so every launcher can import it.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

from torchlaunch.exit_codes import BadInput

PREFIX = "launch error: "

_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_BREAKS = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _shown(value: str, limit: int = 60) -> str:
    """The value as the error line shows it: repr (so control characters are visible), shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _unsafe(char: str) -> bool:
    """Control, format, surrogate, private or unassigned characters and line/paragraph separators:
    any of them may end a line for some reader (bash, YAML 1.1's NEL/LS/PS) or hide text."""
    return unicodedata.category(char)[0] == "C" or unicodedata.category(char) in ("Zl", "Zp")


def escape_line(text: str) -> str:
    """`text` on one line: backslash, line breaks and every unsafe character written as escapes."""
    out = []
    for char in text:
        if char in _BREAKS:
            out.append(_BREAKS[char])
        elif _unsafe(char):
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def comment(text: str, marker: str = "#") -> str:
    """One comment line (shell or YAML) saying `text`; it cannot end early, whatever `text` holds."""
    return f"{marker} {escape_line(text)}".rstrip()


def command_comment(label: str, argv: Sequence[str], marker: str = "#") -> str:
    """`# label: the command as a shell would read it`, for the reader of a script or manifest."""
    return comment(f"{label}: {shlex.join(list(argv))}" if argv else label, marker)


def refuse_nul(value: str, what: str) -> str:
    if "\0" in value:
        raise BadInput(
            f"{PREFIX}{what} {_shown(value)} holds a NUL character, which no command line can carry; remove it"
        )
    return value


def argv_item(value: str, what: str = "argument") -> str:
    """An exec argv element: passed verbatim (no shell reads it); NUL is refused before Popen would raise."""
    return refuse_nul(str(value), what)


def argv_items(values: Iterable[str], what: str = "argument") -> list[str]:
    return [argv_item(value, what) for value in values]


def shell_word(value: str, what: str = "argument") -> str:
    """One shell word that the shell reads back as exactly `value` (single-quoted where needed).

    A newline inside single quotes is data, so it is kept; this is never for a `#` comment (see comment)."""
    return shlex.quote(refuse_nul(str(value), what))


def shell_words(values: Iterable[str], what: str = "argument") -> str:
    return " ".join(shell_word(value, what) for value in values)


def refuse_control(value: str, what: str, fix: str = "remove it") -> str:
    """`value` unchanged when it is one printable line; BadInput naming the character otherwise."""
    for char in value:
        if _unsafe(char):
            raise BadInput(f"{PREFIX}{what} {_shown(value)} holds the control character {char!r}; {fix}")
    return value


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
            f"{PREFIX}--sbatch key {_shown(key)} is not an sbatch option name "
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
            raise BadInput(f"{PREFIX}{what} {_shown(path)} holds {char!r} ({why}); choose a run dir without it")
    return path


def container_mount(path: str, what: str) -> str:
    """A path in pyxis' `--container-mounts SRC:DST[,SRC:DST]`: ':' and ',' would split it."""
    refuse_control(path, what, "choose a path whose name is one printable line")
    for char in (":", ","):
        if char in path:
            raise BadInput(
                f"{PREFIX}{what} {_shown(path)} holds {char!r}, which splits pyxis' --container-mounts; "
                f"choose a path without it"
            )
    return path


def to_yaml(objects: Sequence[Any], header: Sequence[str] = ()) -> str:
    """YAML documents of `objects` (apply order kept), each header line a comment escaped by `comment`.

    PyYAML's emitter chooses the quoting of every scalar; multi-line strings are asked for in block
    style for readability, and the emitter itself falls back to a quoted style where a block scalar
    could not carry the value exactly."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    body = yaml.dump_all(list(objects), Dumper=Dumper, sort_keys=False, explicit_start=True, width=120)
    lines = "".join(comment(line) + "\n" for line in header)
    return lines + body
