"""The only way user text reaches a generated artefact: sbatch scripts, manifests, argv lists, pod commands.

Each emitter either carries a value verbatim (quoted for its target) or refuses it with BadInput, one
line naming the value and the fix. Nothing here formats user text into a script by hand:

- `shell_word` / `shell_words`: a POSIX shell word. Single quotes make every byte but NUL data, a
  newline included, so only NUL (which no argv can carry) is refused.
- `comment`: a `#` line. A newline ends a shell or YAML comment, so line breaks and every other
  control or format character are escaped (`\\n`, `\\x1b`, `\\u2028`), never passed through.
- `refuse_control`: one printable line (a Slurm `#SBATCH` value, torchlaunch.backends.slurm.sbatch).
- `argv_item` / `argv_items`: an exec argv element (torchrun, the single worker): verbatim, NUL refused.
- `to_yaml`: YAML only through PyYAML's safe emitter, header lines only through `comment`.

Torch-free and scheduler-free, so every launcher can import it.
"""

from __future__ import annotations

import shlex
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

from torchlaunch.exit_codes import BadInput

PREFIX = "launch error: "

_BREAKS = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def shown(value: str, limit: int = 60) -> str:
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
            f"{PREFIX}{what} {shown(value)} holds a NUL character, which no command line can carry; remove it"
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
            raise BadInput(f"{PREFIX}{what} {shown(value)} holds the control character {char!r}; {fix}")
    return value


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
