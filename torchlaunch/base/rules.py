"""The rule beside a config field: a bound (a predicate and the words of its error) or a choice.

Why a module of its own on the ground floor: the run's config (torchlaunch.config) and every data
format's own config section (torchlaunch.data.formats.*) declare their fields with these, and the
config sits above the data formats; the vocabulary both use therefore lives below both. It imports
nothing of the project: `torchlaunch.config.rules()` reads the metadata, `validate` applies it.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    """A field's allowed values as a predicate, and the words of the error when it fails."""

    ok: typing.Callable[[Any], bool]
    requirement: str
    """Completes `config error: KEY: <requirement>, got VALUE`."""
    fix: str
    """What to write instead (the error's parenthesis)."""


@dataclass(frozen=True)
class Choice:
    """A string field's (or each list item's) allowed values."""

    values: tuple[str, ...]
    open_prefix: str = ""
    """Also accept any longer value with this prefix (model.name=torchvision.<name>)."""
    plugin: bool = False
    """Also accept an import path `pkg.module:factory` (torchlaunch.worker.plugins resolves it)."""
    source: typing.Callable[[], tuple[str, ...]] | None = None
    """Ask this for the values at each check instead (data.name: the data-format registry, which a
    third-party format joins at run time)."""

    def allowed(self) -> tuple[str, ...]:
        return self.source() if self.source is not None else self.values


def bound(ok: typing.Callable[[Any], bool], requirement: str, fix: str) -> dict[str, Bound]:
    """Field metadata: `field(default=..., metadata=bound(lambda v: ..., "must be ...", "e.g. ..."))`."""
    return {"bound": Bound(ok, requirement, fix)}


MAX_EPOCHS = 10**6
MAX_STEPS = 10**12
"""Caps of the epoch and step counts that several sections bound (optim, train, checkpoint)."""


def _ceiling(high: float, fix: str) -> dict[str, Bound]:
    """Every number has an upper bound a real machine can meet, checked after its lower bound."""
    return {"ceiling": Bound(lambda v: v <= high, f"must be at most {high:g}", fix)}


def at_least(low: int, high: float, fix: str) -> dict[str, Bound]:
    """low <= v <= high."""
    return {**bound(lambda v: v >= low, f"must be >= {low}", fix), **_ceiling(high, fix)}


def above(low: int, high: float, fix: str) -> dict[str, Bound]:
    """low < v <= high."""
    return {**bound(lambda v: v > low, f"must be > {low}", fix), **_ceiling(high, fix)}


def interval(low: float, high: float, ends: str, fix: str) -> dict[str, Bound]:
    """`ends` as written in mathematics: "[)" is low <= v < high, "(]" is low < v <= high."""
    above_low = (lambda v: v >= low) if ends[0] == "[" else (lambda v: v > low)
    below_high = (lambda v: v <= high) if ends[1] == "]" else (lambda v: v < high)
    return bound(lambda v: above_low(v) and below_high(v), f"must be in {ends[0]}{low}, {high}{ends[1]}", fix)


SEED_LIMIT = 2**63
"""Seeds stay below 2**63: torch.manual_seed takes 64 bits and a resume on a new world size seeds
with `seed + global_step`."""


def seed_bound() -> dict[str, Bound]:
    return bound(
        lambda v: 0 <= v < SEED_LIMIT, "must be a non-negative integer below 2**63", "use a seed such as 0 or 1234"
    )


def choice(
    values: tuple[str, ...],
    open_prefix: str = "",
    plugin: bool = False,
    source: typing.Callable[[], tuple[str, ...]] | None = None,
) -> dict[str, Choice]:
    """Field metadata: `field(default=..., metadata=choice(("a", "b")))`."""
    return {"choice": Choice(tuple(values), open_prefix, plugin, source)}


HOST = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[?[0-9A-Fa-f:.]+\]?")
"""A host name or an IPv4/IPv6 address, matched whole (HOST.fullmatch): `$` would also match before a
trailing newline, so `127.0.0.1\\n` passed the check and cut the error line that quoted it."""
SERVICE_ADDRESS = re.compile(r"http://(?P<host>[^/:]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})")


def service_address(value: object, ports: int = 1) -> tuple[str, int] | None:
    """(host, port) of an `http://HOST:PORT` address (a service's, e.g. recovery.lighthouse), or None
    when `value` is not one: a host by HOST, nothing before or after, and PORT in 1..65535 with room for
    the `ports` consecutive ports the service listens on from it (the membership service: 2, its
    presence port is PORT+1, so 65535 would name a port that cannot exist)."""
    match = SERVICE_ADDRESS.fullmatch(value) if isinstance(value, str) else None
    if match is None or not HOST.fullmatch(match["host"]) or not 0 < int(match["port"]) <= 65536 - ports:
        return None
    return match["host"].strip("[]"), int(match["port"])


PLUGIN_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
"""module.path:attr, the import path a Choice with `plugin` accepts: checked without importing anything;
the worker imports it."""


def is_plugin(name: str) -> bool:
    """A `model.name` / `data.name` given as an import path (anything with a colon)."""
    return ":" in str(name)
