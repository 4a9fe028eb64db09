"""Process exit codes: the one table every level maps through, and what each code asks of a scheduler.

A code is decided at four levels, each from the one below: a rank (the runner: its program's end), a
node (the launcher: torchrun's code and the ranks' records, `node_code`), a launch (the node's outcome
once a cancel or a hang is known, `launch_code`), all three in this module, and a Slurm job's final
state (torchlaunch.backends.slurm.follow.scheduler_code, for `--wait`). Codes travel between levels as data (status records, job
records, the Slurm task's result record), never parsed out of a message.

Kept free of torch imports so launchers can use it without loading torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

OK = 0
"""The run finished."""

FAILURE = 1
"""Anything unexpected (a crash, a lost peer): schedulers may retry."""

BAD_INPUT = 2
"""Bad config, data or arguments: a rerun would fail the same way, so never retry."""

PREEMPTED = 75
"""A signal asked us to stop; a checkpoint newer than the run's previous one was committed first, or nothing
was trained since it. A stop that lost steps is FAILURE, with how many. Run the same command again (EX_TEMPFAIL:
Slurm requeues on it, Kubernetes' podFailurePolicy ignores it, a retry loop reruns it)."""

CANCELLED = 3
"""A user stopped the job for good (`python -m launch cancel`, scancel, kubectl delete): the newest
checkpoint is in the run dir, and nothing should run it again. Not 75, which every scheduler reads as
"requeue me"; not 1, which a retry policy reruns; not 2, which says the input is wrong."""

TABLE: dict[int, tuple[str, str]] = {
    OK: ("finished", "nothing"),
    FAILURE: ("failed", "retry per policy"),
    BAD_INPUT: ("bad input", "never retry: fix the input"),
    CANCELLED: ("cancelled", "never retry: a new submission of the same command resumes"),
    PREEMPTED: ("preempted", "run the same command again: it resumes"),
}
"""code -> (its name, what a scheduler should do): the README's exit-code table."""

RETRYABLE = frozenset({FAILURE, PREEMPTED})
"""Codes after which running the same command again is right (for 1, as the scheduler's policy says)."""


def name(code: int) -> str:
    """`preempted`, `bad input`...; `exit N` for a code outside the table (a crash's own code)."""
    return TABLE[code][0] if code in TABLE else f"exit {code}"


def launch_code(outcome: str, code: int) -> int:
    """A launch's exit code from its outcome (torchlaunch.jobs.record.OUTCOMES) and its node code: a hang
    is retryable (1: torchrun restarts, Slurm requeues); a cancelled launch is CANCELLED whatever its
    ranks ended with (they checkpoint and exit 75 on the cancel's SIGTERM)."""
    if outcome == "hung":
        return FAILURE
    if outcome == "cancelled":
        return CANCELLED
    return code


def outcome_of(code: int, *, cancelled: bool = False, hung: bool = False) -> str:
    """The outcome word of a launch's code (before launch_code): what its job record says."""
    if hung:
        return "hung"
    if code == OK:
        return "finished"
    if code == BAD_INPUT:
        return "bad_input"
    if cancelled or code == CANCELLED:
        return "cancelled"
    return "preempted" if code == PREEMPTED else "failed"


def node_code(
    torchrun_code: int,
    worker_codes: Sequence[int],
    ranks: int | None = None,
    *,
    signalled: bool = False,
    records: Sequence[Any] = (),
) -> int:
    """One node's exit code from torchrun's and its ranks' reports (records: torchlaunch.status.Record).
    When all `ranks` local ranks reported a finish, a non-zero torchrun code can only come from a rank's
    C++ teardown after its program ended (gloo sometimes aborts there): the run is done. After the
    launcher forwarded a preemption signal, a run is finished only where every rank's program declared
    it (Record.finished): an undeclared 0 is 75, so the scheduler runs it again; a signal that stopped
    the job before any rank reported (during start-up) is 75 too: nothing was lost, and exit 1 would be
    retried by policy as a failure."""
    complete = bool(worker_codes) and (ranks is None or len(worker_codes) == ranks)
    if signalled and not worker_codes:
        return PREEMPTED  # stopped before any rank could report (start-up): nothing lost, run it again
    if signalled and complete and all(c in (OK, PREEMPTED) for c in worker_codes):
        if not (records and all(r.finished for r in records if r.code == OK)) or PREEMPTED in worker_codes:
            return PREEMPTED
    if torchrun_code == 0:
        return OK
    if ranks is not None and len(worker_codes) == ranks and all(c == OK for c in worker_codes):
        return OK
    if BAD_INPUT in worker_codes or (torchrun_code == BAD_INPUT and not worker_codes):
        return BAD_INPUT  # no record at all: a full disk kept them out; the live agent passes its ranks' 2 on
    if PREEMPTED in worker_codes and FAILURE not in worker_codes:
        return PREEMPTED
    return FAILURE


class BadInput(Exception):
    """An input problem that the user must fix; becomes one line on stderr and exit code 2."""


class ConfigError(BadInput):
    """A config problem, rendered as `config error: <key>: <what is wrong> (<how to fix>)`: the one form of
    every config message, wherever the problem is found (parsing, validation, or the worker at start-up)."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        key = _bounded(key, 200)  # a key comes from the user too: cut, one line
        super().__init__(f"config error: {key}: {_bounded(problem, 1000)} ({_bounded(fix, 400)})")
        self.key = key


WORKER_WRAPPED = "\nOriginal Traceback (most recent call last):"
"""What torch's ExceptionWrapper puts between "Caught X in DataLoader worker process N." and the worker's
traceback when it raises X again in the training process, as X(that whole text)."""


def unwrapped(text: str) -> str:
    """The worker's own message when `text` is torch's re-raise of an error from a DataLoader worker
    (its last line is `pkg.X: message`, our messages being one line), else `text`. Why: the wrapper's
    text begins with the traceback, so an error line cut to its bound showed torch's frames and lost the
    shard, member and reason at its end (issue 52)."""
    if WORKER_WRAPPED not in text:
        return text
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    name, sep, message = last.partition(": ")
    return message if sep and name.replace(".", "").replace("_", "").isalnum() else text


def _bounded(text: str, limit: int) -> str:
    """One line of at most `limit` characters: the last guard of an error line's length (values in it
    are quoted with torchlaunch.base.untrusted.quote where they are formatted)."""
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
        raise BadInput(f"{self.error_prefix}{message}{self._hint(message)} (see {self.prog} --help)")

    def _hint(self, message: str) -> str:
        """`; did you mean --gpus?` for the first unrecognized option that is near one of ours."""
        from torchlaunch import suggest

        if not message.startswith("unrecognized arguments: "):
            return ""
        ours = [o for o in self._option_string_actions if o.startswith("--")]
        for word in message.removeprefix("unrecognized arguments: ").split():
            near = suggest.closest_option(word, ours) if word.startswith("--") else None
            if near:
                return f"; did you mean {near}?"
        return ""


class LaunchParser(ArgumentParser):
    """The launchers' and operator commands' parser: `launch error: ...`, the launchers' one prefix."""

    error_prefix = "launch error: "
