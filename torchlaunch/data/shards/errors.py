"""The one error type of the shard storage layer: bad data the user must fix, one line, exit 2."""

from __future__ import annotations

from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import BadInput, _bounded, unwrapped

NAME_LIMIT = 120
"""Longest member, key or file name shown in an error line, in characters."""


class ShardError(BadInput):
    """A missing, truncated, corrupt or foreign shard or index, or an undecodable member.

    The message starts with "data error:" (the prefix the loaders' re-raise path keeps as one line),
    names the shard and member where there is one, and ends with the fix in parentheses. It is one
    bounded line whatever the text in it: names come from files anyone may have written (a tar key may
    hold a newline), so line breaks are escaped and the parts are cut (exit_codes._bounded), the last
    guard behind `shown` at the places that format a name."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        what = unwrapped(what)  # raised again by torch from a loader worker: the worker's own line
        super().__init__(
            _bounded(what, 1400) if fix is None else f"data error: {_bounded(what, 1000)} ({_bounded(fix, 800)})"
        )

    def __reduce__(self) -> tuple:
        # the whole line is the one argument: a DataLoader worker's error unpickles to the same message
        return (ShardError, (str(self),))


def shown(name: str, limit: int = NAME_LIMIT) -> str:
    """A name from a shard (member, key, file name) as an error line shows it: bare when it is plain
    printable text without spaces or quotes (the usual `n01440764_10026.JPEG`), else repr-quoted and
    cut (untrusted.quote): a newline, an escape sequence or bytes that are not UTF-8 (tarfile hands them
    over as surrogates) can neither cut the line nor forge another one."""
    plain = name.isprintable() and len(name) <= limit and not any(c in name for c in " '\"\\")
    return name if plain else quote(name, limit)
