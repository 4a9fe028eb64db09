"""Process exit codes shared by every launcher and the worker.

Kept free of torch imports so launchers can use it without loading torch.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

OK = 0
"""The run finished."""

FAILURE = 1
"""Anything unexpected (a crash, a lost peer): schedulers may retry."""

BAD_INPUT = 2
"""Bad config, data or arguments: a rerun would fail the same way, so never retry."""

PREEMPTED = 75
"""A signal asked us to stop; a checkpoint was committed first. Run the same command again."""


class BadInput(Exception):
    """An input problem that the user must fix; becomes one line on stderr and exit code 2."""


class ConfigError(BadInput):
    """A config problem, rendered as `config error: <key>: <what is wrong> (<how to fix>)`: the one form of
    every config message, wherever the problem is found (parsing, validation, or the worker at start-up)."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        key = _bounded(key, 200)  # a key comes from the user too: cut, one line
        super().__init__(f"config error: {key}: {_bounded(problem, 1000)} ({_bounded(fix, 400)})")
        self.key = key


def _bounded(text: str, limit: int) -> str:
    """One line of at most `limit` characters: the last guard of an error line's length (values in it
    are quoted with torchlaunch.untrusted.quote where they are formatted)."""
    text = str(text).replace("\n", "\\n").replace("\r", "\\r")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose refusals are BadInput (one line, exit 2 where it is caught), not usage + message
    with argparse's own exit: `<error_prefix><what argparse says> (see <prog> --help)`."""

    error_prefix = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--rank 1` is refused, never read as `--rank-prefix`
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{self.error_prefix}{message} (see {self.prog} --help)")


class LaunchParser(ArgumentParser):
    """The launchers' and operator commands' parser: `launch error: ...`, the launchers' one prefix."""

    error_prefix = "launch error: "
