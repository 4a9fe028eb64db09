"""Bounded parsing of text anyone may have written: config YAML, overrides, the run dir's JSON records.

A run dir is shared storage and a config is user input, so their size, nesting and alias expansion are
capped before anything recursive (a composer, a repr, an error message) touches them: a 100,000-deep
list is refused in milliseconds instead of a RecursionError, an anchor bomb is refused before it is
expanded, and every value quoted in an error line is cut to a bounded length (`quote`). Torch-free,
so launchers use it before anything starts.
"""

from __future__ import annotations

import json
import re
import reprlib
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of lists/mappings accepted: a config is 3 levels deep, a marker 2."""
MAX_NODES = 10_000
"""Most values a YAML document may hold once its aliases are expanded: a config holds ~100, and the
pure-Python loader composes ~30,000 a second, so the cap also bounds the time to the first error."""
QUOTE_LIMIT = 120
"""Longest quoted value in an error line, in characters."""


def whole(text: str, max_digits: int = 18) -> int | None:
    """`text` as a whole number when it is 1..max_digits ASCII digits, else None. The one test for a
    count, a port, a job id or a PID read from a command line, the environment, a file or the network:
    str.isdigit() also takes digits int() refuses ('\u00b2': a traceback) or reads as numbers no one
    typed ('\u0665')."""
    return int(text) if 0 < len(text) <= max_digits and text.isascii() and text.isdigit() else None


class TooComplex(ValueError):
    """Text nested deeper, or expanding to more values, than any real config or record."""


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = QUOTE_LIMIT
_REPR.maxother = QUOTE_LIMIT
_REPR.maxlong = 40
for _name in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_REPR, _name, 6)


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """repr(value) in bounded time and at most `limit` characters on one line: for error messages,
    whose values may be huge, deep, self-referencing or hold line breaks."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still named
        text = f"<{type(value).__name__}>"
    text = text.replace("\n", "\\n").replace("\r", "\\r")
    return text if len(text) <= limit else text[: limit - 3] + "..."


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """Deepest bracket nesting of JSON text (strings skipped), without parsing it."""
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def load_json(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads for untrusted text: nesting over `max_depth` is TooComplex and NaN/Infinity a
    ValueError (json.dump of finite numbers never writes them), before the recursive parser runs."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    # every bracket, in strings too, bounds the depth from above: few brackets skip the string pass
    # (a 100,000-shard manifest is 2 MB of names in one list: issue 38)
    if text.count("[") + text.count("{") > max_depth and json_depth(text) > max_depth:
        raise TooComplex(f"is nested more than {max_depth} levels deep")
    return json.loads(text, parse_constant=_no_constant)


def check_yaml(text: str, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Raise TooComplex when the YAML text nests deeper than `max_depth` or holds more than `max_nodes`
    values once aliases are expanded (counted from the event stream, nothing is built); syntax errors
    are left to the loader, which names their line."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (values, depth) of its expansion
    stack: list[list[Any]] = []  # open collections: [anchor, values, deepest child depth]
    total = 0

    def add(values: int, depth: int, alias: bool = False) -> None:
        nonlocal total
        total += values
        how = " once its aliases are expanded" if alias else ""
        if total > max_nodes:
            raise TooComplex(f"holds more than {max_nodes} values{how}")
        if len(stack) + depth > max_depth:
            raise TooComplex(f"is nested more than {max_depth} levels deep{how}")
        if stack:
            stack[-1][1] += values
            stack[-1][2] = max(stack[-1][2], depth)

    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.ScalarEvent):
                add(1, 0)
                if event.anchor:
                    anchors[event.anchor] = (1, 0)
            elif isinstance(event, yaml.AliasEvent):
                if any(frame[0] == event.anchor for frame in stack):
                    raise TooComplex(f"has an alias *{quote(event.anchor, 40)} inside its own anchor (a loop)")
                add(*anchors.get(event.anchor, (1, 0)), alias=True)
            elif isinstance(event, yaml.CollectionStartEvent):
                add(1, 1)
                stack.append([event.anchor, 1, 0])
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, values, depth = stack.pop()
                if anchor:
                    anchors[anchor] = (values, depth + 1)
                if stack:  # the collection itself was counted when it opened
                    stack[-1][1] += values - 1
                    stack[-1][2] = max(stack[-1][2], depth + 1)
            elif isinstance(event, yaml.DocumentEndEvent):
                anchors.clear()
    except yaml.YAMLError as e:
        if "nesting depth" in str(e):  # libyaml's own cap (1000), met while it scans ahead
            raise TooComplex(f"is nested more than {max_depth} levels deep") from None
        return  # a syntax error: the loader names its line


class DepthGuard:
    """Mixin for a PyYAML Loader: composing a node nested deeper than MAX_DEPTH is TooComplex, so
    the recursive composer never runs out of stack (check_yaml's scan may stop early at a syntax
    error that libyaml saw ahead; this guard holds wherever the scan stopped)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise TooComplex(f"is nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1
