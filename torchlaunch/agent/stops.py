"""Stop signals on their way to the ranks: the one relay from this agent to its child, the ranks'
grace, and the stops that arrived before the child existed.

Why one relay: a stop reaches the agent from a kubelet, `docker stop`, a terminal's Ctrl-C or a
scheduler, and the ranks must hear of it exactly once (a second SIGTERM makes torchrun kill its
ranks mid-checkpoint); a stop before the child started is a preemption (75), never a crash.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Mapping

from torchlaunch import grace, pdeath
from torchlaunch import runner as program_mod

FORWARDED_SIGNALS = program_mod.PREEMPTION_SIGNALS


EARLY_SIGNALS: list[int] = []
"""Stop signals that arrived before the child existed: a scheduler may stop the job while this
launcher is still planning; that is a preemption (75, run me again), not a crash of the launcher."""


def note_early_signal(signum: int, frame: object) -> None:
    EARLY_SIGNALS.append(signum)


SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""How long torchrun's agent waits for its ranks after passing on a stop before it SIGKILLs them: set
from the platform's grace (torchlaunch.grace: the pod's, docker's 10 s in a container, torch's 30 s
where no platform is seen), not torch's fixed 30 s, which docker's 10 s cut short; `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` in the launcher's
environment wins. The ranks drop the step in flight on a stop (core/step_drop.py), so what must fit
in it is one checkpoint."""


def stop_env(environ: Mapping[str, str], container: bool | None = None) -> dict[str, str]:
    """The ranks' grace (TORCHLAUNCH_GRACE_S, for their save-time check) and torchrun's window from it."""
    seconds, _ = grace.platform_grace(environ, container)
    return {grace.GRACE_ENV: f"{seconds:g}", SHUTDOWN_TIMEOUT_ENV: str(grace.ranks_window_s(seconds))}


class StopRelay:
    """The launcher's handler for every stop signal, wherever it came from (a kubelet or `docker stop`
    to this PID, Ctrl-C to the terminal's process group, a scheduler to every process).

    The child (torchrun's agent, or the single worker) runs in a process group of its own, so a
    terminal's signals reach this process alone and the ranks hear of a stop exactly once: the first
    stop signal is passed on as one SIGTERM, which torchrun forwards to each rank's process group (the
    ranks checkpoint at one agreed step; their loader workers are shielded, torchlaunch.stop_signals).
    Later signals are the same stop and are not passed on again (a second SIGTERM would make torchrun
    abandon its graceful shutdown and kill the ranks mid-checkpoint), except a second SIGINT: a person
    pressing Ctrl-C again wants out now, so the whole tree is killed at once (exit 3, cancelled)."""

    def __init__(self, received: list[int], children: list[subprocess.Popen]) -> None:
        self.received = received
        self.children = children
        self.interrupted = False
        self._passed_on = False

    def receive(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if signum == signal.SIGINT and self.received.count(signal.SIGINT) >= 2:
            self.interrupted = True
            for child in self.children:
                pdeath.kill_tree(child.pid)
            return
        self.pass_on()

    def pass_on(self) -> None:
        if self._passed_on:
            return
        for child in self.children:
            self._passed_on = True
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        first = self.received[0] if self.received else signal.SIGTERM
        if self._passed_on and first != signal.SIGTERM:  # the ranks will say SIGTERM: say what came (issue 51)
            again = "; Ctrl-C again stops at once, without a checkpoint" if first == signal.SIGINT else ""
            line = f"launch: {signal.Signals(first).name}: passed on to the ranks as SIGTERM, the stop every program"
            os.write(2, f"{line} handles (they checkpoint at one agreed step){again}\n".encode())  # handler-safe


def own_group_dying_with(die_with_parent: Callable[[], None] | None) -> Callable[[], None]:
    """A Popen preexec_fn: the child leads a process group of its own (see StopRelay), and still dies
    with this launcher (pdeath.die_with_parent), since a group kill of the launcher no longer reaches it."""

    def preexec() -> None:
        os.setpgid(0, 0)
        if die_with_parent is not None:
            die_with_parent()

    return preexec
