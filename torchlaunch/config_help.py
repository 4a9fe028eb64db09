"""`python -m train --help-config`: every key with its default and the first sentence of its meaning.

The meaning is the docstring under the field in its section's source (each section beside its
component), read back here: Python keeps no attribute docstrings at run time.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap

import yaml

from torchlaunch import config
from torchlaunch.data import section


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal under it in the class's source, the one place a
    key's meaning is written (Python keeps no attribute docstrings at run time, so it is read back here).
    A composed section (the data section) has no source of its own: its fields' docstrings are read
    from the classes it names in `__sections__`, each format's section from its own module."""
    docs: dict[str, str] = {}
    for source in getattr(cls, section.SECTIONS, (cls,)):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(source)))
        except (OSError, TypeError, SyntaxError):  # no source (a frozen install): keys without meanings
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def first_sentence(text: str, limit: int = 160) -> str:
    """The meaning's first sentence (not cut at "e.g."), at most `limit` characters."""
    found = re.match(r"(.*?(?<!e\.g)(?<!i\.e)\.)(\s|$)", text)
    short = found.group(1) if found else text
    return short if len(short) <= limit else short[: limit - 3] + "..."


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def key_help(cls: type = config.RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as written in YAML, first sentence of its docstring) of every leaf, in
    field order: what `python -m train --help-config` prints."""
    found: list[tuple[str, str, str]] = []
    typed, docs = config.hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(typed[f.name]):
            found.extend(key_help(typed[f.name], prefix + f.name + "."))
        else:
            found.append((prefix + f.name, _default_text(f), first_sentence(docs.get(f.name, ""))))
    return found


def help_config() -> str:
    """Every key as `key=DEFAULT  # meaning`, aligned: the text of `--help-config`."""
    rows = [(f"{key}={default}", meaning) for key, default, meaning in key_help()]
    width = min(max(len(left) for left, _ in rows), 48)
    return "\n".join(f"{left:<{width}}  # {meaning}" if meaning else left for left, meaning in rows)
