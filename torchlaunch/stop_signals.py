"""The stop signals, spelled once, and the rule that only the rank acts on them (stdlib only).

A stop reaches a rank's process tree however the world sends it: to the launcher alone (a kubelet,
`docker stop`), to a process group (Ctrl-C, torchrun's forwarding: `killpg` of each worker's group),
or to every process of the job (Slurm's preemption and `scancel --signal`, which walk the whole tree).
The last two also hit the rank's DataLoader workers. A forked worker inherits the rank's handlers only
until torch or the user's code replaces them, and a worker that dies of the signal takes the rank with
it ("DataLoader worker (pid N) is killed by signal: Terminated") before the rank reaches its
checkpoint. So the rank owns the decision and its forked children never act on a stop signal:

- `shield_forked_children()` (the rank runner calls it, for every program on every launcher): every
  child the rank forks (DataLoader workers with the default `fork` context, multiprocessing `fork`
  processes) starts with the stop signals blocked and dies with the rank (PR_SET_PDEATHSIG, where it
  was forked from the rank's main thread). Blocked, not handled: torch's loader worker installs a C
  SIGTERM handler of its own at start (it exits quietly when its parent sends SIGTERM and re-raises
  the default action for anyone else's), which would replace any handler set at fork. The rank
  decides, checkpoints, exits, and its children end with it, also when a second Ctrl-C ends the rank
  at once. A loader worker the rank stops normally is told through its queue, not by a signal.
- `loader_worker_init(worker_id)`: the same for loader workers started by `spawn` or `forkserver`, which
  run no fork hook: pass it as `DataLoader(worker_init_fn=...)` (`torchlaunch.api.loader_worker_init`).
  Such a worker is shielded from its init on: a stop in the second or so while it imports still kills
  it (the fork context has no such window).

A signal mask is inherited across exec: a program a shielded child starts (a decoder binary run by
subprocess from a loader worker) starts with the stop signals blocked too. A child that wants them
for itself, or for what it starts, calls `unshield()`.
"""

from __future__ import annotations

import os
import signal
import threading

STOP_SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
"""What schedulers, a kubelet and a terminal send before a stop: SIGTERM (Kubernetes, docker stop,
scancel), SIGINT (Ctrl-C), SIGUSR1/SIGUSR2 (Slurm's --signal, submitit's default), SIGHUP (a closed
terminal or ssh session). The one definition: the runner, the launchers' forwarding, the built-in
worker's default `preemption.signals` and the API's default read it."""

STOP_SIGNALS: tuple[int, ...] = tuple(getattr(signal, name) for name in STOP_SIGNAL_NAMES if hasattr(signal, name))


class EarlyStop:
    """A stop signal that arrives before the program's own handler is in place. A Slurm task starts
    under submitit's handlers, whose SIGUSR2 handler requeues the job, also when the stop is a cancel
    (`launch cancel` -> scancel -> the batch shell's USR2 to the step). The task puts this in their
    place at once (hold_early_stops), and it only records the first stop signal. The handler that
    replaces it (runner.SignalOwner, core.preemption.PreemptionWatcher) takes that signal over
    (taken_over), so a stop during start-up is acted on as any later one: a cancel ends the job, and a
    preemption checkpoints and requeues once."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum


HELD_EARLY = tuple(sig for sig in STOP_SIGNALS if sig != signal.SIGINT)
"""What hold_early_stops takes: SIGINT keeps Python's KeyboardInterrupt, as under the runner."""


def hold_early_stops() -> EarlyStop:
    """Record the stop signals from now until a program's handler replaces this one (main thread only;
    elsewhere nothing changes)."""
    early = EarlyStop()
    if threading.current_thread() is threading.main_thread():
        for sig in HELD_EARLY:
            signal.signal(sig, early)
    return early


def taken_over(previous: object) -> int | None:
    """The stop signal an EarlyStop handler recorded, when it is the handler being replaced. Handed
    over once: a later handler that replaces it again (after a restore) takes no stop from it."""
    if not isinstance(previous, EarlyStop):
        return None
    signum, previous.signum = previous.signum, None
    return signum


_forked_from_main_thread = False
_registered = False


def shield_child() -> None:
    """In a child of the rank: block the stop signals (the rank decides and ends its children), and
    leave the rank's wake-up pipe to the rank (runner.SignalWatch reads it). Called by the fork hook,
    and by loader_worker_init for spawned workers."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread: there is no wake-up fd to leave
        pass


def unshield() -> None:
    """In a shielded child that wants the stop signals for itself (or for the programs it starts)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _before_fork() -> None:
    global _forked_from_main_thread
    _forked_from_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    shield_child()
    if _forked_from_main_thread:
        # The kernel signals on the death of the forking *thread*: only the main thread's lives as long
        # as the rank. A child forked by a short-lived thread keeps torch's own parent watch instead.
        from torchlaunch import pdeath

        pdeath.die_with_parent_now(signal.SIGKILL)


def shield_forked_children() -> None:
    """Register the fork hook once per process (the rank runner, before the program starts)."""
    global _registered
    if _registered or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _registered = True


def _ignore(signum: int, frame: object) -> None:
    """A spawned loader worker's handler for the stop signals its other threads may still receive."""


def loader_worker_init(worker_id: int) -> None:
    """`DataLoader(worker_init_fn=loader_worker_init)`: a loader worker started by `spawn` or
    `forkserver` ignores the stop signals meant for its rank, as a forked one does by the fork hook.
    Harmless with `fork` (the hook already ran). Chain it from your own worker_init_fn if you have one.

    By the time it runs the worker has threads of its own, which a mask set here does not cover, so a
    process-directed signal could still land on one of them and reach torch's C SIGTERM handler: the
    stop signals also get a do-nothing handler (in place of torch's), which reset to the default action
    in anything the worker execs."""
    del worker_id
    shield_child()
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, _ignore)
