"""test_stop_signals: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_stop_signals_processes.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from torchlaunch import stop_signals
from torchlaunch.core.preemption import PreemptionWatcher
from torchlaunch.jobs import ranklog


def test_one_definition_of_the_stop_signals() -> None:
    assert set(ranklog.TEE_IGNORES) == set(stop_signals.STOP_SIGNALS)  # the tee imports the stdlib only
    from torchlaunch import api, runner
    from torchlaunch.core.preemption_section import PreemptionConfig

    assert runner.PREEMPTION_SIGNALS == stop_signals.STOP_SIGNALS
    assert tuple(api.SIGNALS) == tuple(PreemptionConfig().signals) == stop_signals.STOP_SIGNAL_NAMES


def test_a_second_sigint_ends_at_once_and_other_repeats_are_the_same_stop() -> None:
    watcher = PreemptionWatcher(["SIGTERM", "SIGINT"])
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the batch shell and the task both passed it on
        assert watcher.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: the same stop
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        watcher.restore()


SIGINT_BEFORE: list[object] = []
"""SIGINT's handler before each hold_early_stops(): a shell that starts a job in the background leaves
SIGINT ignored, and Python then keeps it so instead of installing default_int_handler."""


@pytest.fixture
def held_early_stops():  # noqa: ANN201 - the EarlyStop, with the handlers it replaced restored after
    before = {sig: signal.getsignal(sig) for sig in stop_signals.HELD_EARLY}
    SIGINT_BEFORE.append(signal.getsignal(signal.SIGINT))
    try:
        yield stop_signals.hold_early_stops()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_stop_while_a_task_starts_is_only_recorded(held_early_stops: stop_signals.EarlyStop) -> None:
    """In place of submitit's handlers (whose SIGUSR2 requeues the job, also on a cancel): the first
    stop signal is recorded, nothing else happens; SIGINT keeps Python's own handler."""
    assert signal.getsignal(signal.SIGINT) is SIGINT_BEFORE[-1]  # Python's own (SIG_IGN when started in the background)
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGTERM)
    assert held_early_stops.signum == signal.SIGUSR2
    assert stop_signals.taken_over(held_early_stops) == signal.SIGUSR2
    assert stop_signals.taken_over(held_early_stops) is None  # handed over once
    assert stop_signals.taken_over(signal.SIG_DFL) is None


def test_the_builtin_workers_watcher_takes_over_a_stop_that_came_during_start_up(
    held_early_stops: stop_signals.EarlyStop,
) -> None:
    os.kill(os.getpid(), signal.SIGUSR2)
    watcher = PreemptionWatcher(["SIGTERM", "SIGUSR2"])
    try:
        assert watcher.requested and watcher.signum == signal.SIGUSR2  # it checkpoints at the first boundary
    finally:
        watcher.restore()
    quiet = PreemptionWatcher(["SIGTERM", "SIGUSR2"])  # the stop was handed over once: none now
    try:
        assert not quiet.requested
    finally:
        quiet.restore()


def test_a_user_program_stopped_during_start_up_is_not_started(
    held_early_stops: stop_signals.EarlyStop, tmp_path: Path
) -> None:
    """The runner's own handler takes the recorded stop over: the program never runs, and the rank's
    outcome is a stop (75), which the Slurm task turns into a cancel or one requeue."""
    from torchlaunch import runner

    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    os.kill(os.getpid(), signal.SIGUSR2)
    owner = runner.SignalOwner()
    try:
        code, reason = runner.outcome(runner.parse([str(script)]), owner=owner)
    finally:
        owner.close()
    assert code == runner.PREEMPTED and "SIGUSR2" in reason, reason
    assert not (tmp_path / "ran").exists()
