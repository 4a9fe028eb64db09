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
        super().__init__(f"config error: {key}: {problem} ({fix})")
        self.key = key


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
