"""test_stop_signals: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_stop_signals.py.
"""

from __future__ import annotations

import os
import signal

import pytest

from torchlaunch import stop_signals
from torchlaunch.core.preemption import PreemptionWatcher
from torchlaunch.jobs import ranklog


def test_one_definition_of_the_stop_signals() -> None:
    assert set(ranklog.TEE_IGNORES) == set(stop_signals.STOP_SIGNALS)  # the tee imports the stdlib only
    from torchlaunch import api, config, runner

    assert runner.PREEMPTION_SIGNALS == stop_signals.STOP_SIGNALS
    assert tuple(api.SIGNALS) == tuple(config.PreemptionConfig().signals) == stop_signals.STOP_SIGNAL_NAMES


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
