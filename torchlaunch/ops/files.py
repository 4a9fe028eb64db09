"""Small JSON files that other processes read while they are written: atomic replace, tolerant read.

A writer never leaves half a file (temp name, then os.replace); a reader treats a missing, oversized,
truncated, non-UTF-8 or non-object file as absent and says why, because a run dir is shared storage
that anything may have written: its contents are data, never trusted to be well-formed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MAX_BYTES = 256 * 1024
"""Larger files are refused unread: a record is a few hundred bytes."""


def write_json(path: Path, payload: dict[str, Any], *, durable: bool = False) -> None:
    """Replace `path` atomically; `durable` fsyncs first (records that must survive a crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(payload, sort_keys=True).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(object, None), or (None, why it cannot be used); never raises."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e.strerror or type(e).__name__})"
    if len(raw) > MAX_BYTES:
        return None, f"larger than {MAX_BYTES} bytes"
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not valid JSON (truncated?)"
    except RecursionError:
        return None, "nested too deeply"
    if not isinstance(value, dict):
        return None, "not a JSON object"
    return value, None


def as_int(value: Any, low: int | None = None, high: int | None = None) -> int | None:
    """An int field from untrusted JSON (bools and out-of-range values are None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if (low is not None and value < low) or (high is not None and value > high):
        return None
    return value


def as_float(value: Any, low: float | None = None) -> float | None:
    """A finite number from untrusted JSON, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        return None
    if low is not None and number < low:
        return None
    return number


def as_str(value: Any, limit: int = 4096) -> str | None:
    """A string field from untrusted JSON, cut to `limit` characters."""
    return value[:limit] if isinstance(value, str) else None


def printable(text: str) -> str:
    """`text` safe for a terminal: control characters (escape sequences, newlines) shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
