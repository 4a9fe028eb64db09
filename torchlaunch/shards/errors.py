"""The one error type of the shard storage layer: bad data the user must fix, one line, exit 2."""

from __future__ import annotations

from torchlaunch.exit_codes import BadInput


class ShardError(BadInput):
    """A missing, truncated, corrupt or foreign shard or index, or an undecodable member.

    The message starts with "data error:" (the prefix the loaders' re-raise path keeps as one line),
    names the shard and member where there is one, and ends with the fix in parentheses."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        super().__init__(what if fix is None else f"data error: {what} ({fix})")

    def __reduce__(self) -> tuple:
        # the whole line is the one argument: a DataLoader worker's error unpickles to the same message
        return (ShardError, (str(self),))
