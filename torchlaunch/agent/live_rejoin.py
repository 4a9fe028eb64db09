"""What the live agent (live.py) does when one of its ranks ends before the others: start a rank lost
to a signal again to rejoin the group (recovery.rejoin), stop the others after a rank failed by
itself, and leave alone or end a rank started again that never joined; and, after a stop, end the
ranks still running past their window, as torchrun's agent does.

Why apart from the agent's loop: each is one rule over the ranks' exit codes, tested on its own with
real processes, while the loop only calls them in turn.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import OK, PREEMPTED


class Joiners:
    """Which of this node's ranks join a group that trains (rather than form the first one), and with
    which attempt number (its replica id: membership.replica_id_of): a rank started again by this agent
    (recovery.rejoin), and every rank of a node that replaces a lost one (`base`, from the launcher).
    Attempts grow from `base`, so a replacement's ids differ from those its lost node used."""

    def __init__(self, base: int, restarts: list[int]) -> None:
        self.base, self.restarts = base, restarts

    def __call__(self, rank: int) -> bool:
        return bool(self.base or self.restarts[rank])

    def attempt(self, rank: int) -> int:
        return self.base + self.restarts[rank]


def rejoin(
    ranks: list[subprocess.Popen],
    restarts: list[int],
    limit: int,
    fenced: dict[int, str],
    replaced: list[str],
    start: Callable[[int], subprocess.Popen],
) -> None:
    """Start each rank lost to a signal again (recovery.rejoin times at most), while another rank trains:
    the new process joins the live group at the others' next check point, with a peer's state."""
    for rank, proc in enumerate(ranks):
        code = proc.poll()
        if code is None or code >= 0 or restarts[rank] >= limit:
            continue
        if not any(p.poll() is None for r, p in enumerate(ranks) if r != rank):
            continue  # nobody left to join: the job's outcome is the others'
        why = signal.Signals(-code).name + (", " + fenced.pop(rank) if rank in fenced else "")
        replaced.append(f"rank {rank} ({why}; started again)")
        restarts[rank] += 1
        print(
            f"live: rank {rank} lost ({why}); started again to rejoin the others (attempt {restarts[rank]} of {limit})",
            file=sys.stderr,
            flush=True,
        )
        ranks[rank] = start(rank)


FAILURE_GRACE_S = 10.0
"""How long the other ranks get to leave by themselves after one failed (they usually fail alike)."""


def stop_after_a_failure(
    ranks: list[subprocess.Popen], failed_at: float | None, abandoned: set[int] | frozenset[int] = frozenset()
) -> float | None:
    """A rank that exited by itself with a failure or bad input (not a loss, not a preemption) makes
    the job's outcome: as under torchrun, the others are stopped (SIGKILL after FAILURE_GRACE_S) rather
    than left waiting in their next collective for dist.timeout_s. Returns when the first failure was
    seen. `abandoned` ranks (started again, failed before joining) are no failure of the job's."""
    failed = [
        r
        for r, p in enumerate(ranks)
        if r not in abandoned and p.poll() not in (None, OK, PREEMPTED) and (p.returncode or 0) > 0
    ]
    if not failed:
        return failed_at
    now = time.monotonic()
    if failed_at is None:
        return now
    if now - failed_at >= FAILURE_GRACE_S:
        for rank, proc in enumerate(ranks):
            if proc.poll() is None:
                print(
                    f"live: rank {failed[0]} exited {ranks[failed[0]].returncode}; stopping rank {rank}",
                    file=sys.stderr,
                    flush=True,
                )
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return failed_at


def stop_window_s(environ: dict[str, str] | None = None) -> float:
    """The ranks' window after a stop (torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which the launcher sets
    from the platform's grace: agent/stops.py), 30 s (torch's default) when unset or unreadable."""
    raw = (os.environ if environ is None else environ).get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    seconds = whole(raw, 6)
    return float(seconds) if seconds is not None else 30.0


def end_past_the_stop_window(ranks: list[subprocess.Popen], stopped_at: float | None, window_s: float) -> None:
    """A stop passed on to the ranks (they checkpoint and exit 75) that they have not ended within their
    window (a save stalled on a hung file system): SIGKILL each with its process group, as torchrun's
    agent does, so that the launcher ends within the platform's grace and reports the steps lost
    instead of waiting for the platform's own SIGKILL (none comes on a plain host)."""
    if stopped_at is None or time.monotonic() - stopped_at < window_s:
        return
    for rank, proc in enumerate(ranks):
        if proc.poll() is None:
            print(f"live: rank {rank} still running {window_s:g} s after the stop; ended", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def abandon_failed_joiners(
    ranks: list[subprocess.Popen], joiner: Callable[[int], bool], joined: set[int], abandoned: set[int]
) -> None:
    """A rank started again that exits non-zero before it joined (no group formed for it in
    recovery.quorum_timeout_s, no state to take) never trained in the live group: the others train on
    and the job's outcome stays theirs, where a failure would stop them all (stop_after_a_failure)."""
    for rank, proc in enumerate(ranks):
        code = proc.poll()
        if rank in abandoned or not joiner(rank) or rank in joined or code is None or code <= 0:
            continue
        abandoned.add(rank)
        print(
            f"live: rank {rank} was started again but failed before it joined (exit {code}); the others train on",
            file=sys.stderr,
            flush=True,
        )


def end_orphan_joiners(ranks: list[subprocess.Popen], joiner: Callable[[int], bool], joined: set[int]) -> None:
    """A rank started again that has not joined yet, once every other rank of this node has ended, has
    nobody to join: it is stopped (its peers' outcome is the job's), rather than waiting out
    recovery.quorum_timeout_s. Where every rank of this node is such a joiner (a node of one rank, a
    replacement node), the ranks it would join train on other nodes: nothing here says they ended, and
    the joiner's own quorum timeout bounds its wait."""
    waiting = [r for r, p in enumerate(ranks) if joiner(r) and r not in joined and p.poll() is None]
    if not waiting:
        return
    others = [p for r, p in enumerate(ranks) if r not in waiting]
    if not others or any(p.poll() is None for p in others):
        return
    for rank in waiting:
        print(f"live: rank {rank} was started again, but the others finished first", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(ranks[rank].pid, signal.SIGKILL)
        ranks[rank].wait()
