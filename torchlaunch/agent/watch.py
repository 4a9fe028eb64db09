"""The hang watchdog's end of a stuck node: the ranks it killed, and torchrun's agent when it neither
exits nor starts new ranks after that.

Why: an agent cut off from node 0's rendezvous store blocks in a store read nothing bounds (faults
suite: 300 s after a cut link it was still there, its workers dead), so the launch would never end.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from torchlaunch import pdeath
from torchlaunch.base import procs as ops_procs
from torchlaunch.jobs import watchdog
from torchlaunch.jobs.progress import RankBeat

AGENT_GRACE_S = 30.0
"""After the watchdog ended the hung ranks: how long torchrun's agent gets to exit or start a new group.
Exiting takes it < 1 s where node 0's rendezvous store answers and at most its rendezvous close timeout
(30 s) where that times out; an agent cut off from the store blocks in a store read that nothing bounds
(faults suite, link cut for good: node 1's agent was still there 300 s after the cut, its worker killed)."""


def end_stuck_agent(
    child: subprocess.Popen, killed: Sequence[int], grace_s: float = AGENT_GRACE_S, err: IO[str] | None = None
) -> bool:
    """Called by the watchdog's thread after it killed the ranks `killed`: if torchrun's agent `child`
    neither exited nor started new workers (a restart) within `grace_s`, kill it and what it started
    (it would never exit on its own: its workers are dead and the job cannot progress) and say so in one
    line; the launcher then ends 1 (hung, retryable). True when it was ended. The tree is killed by pid,
    not by process group: the agent shares this launcher's group, its workers have sessions of their own."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if child.poll() is not None or restarted_workers(child.pid, killed):
            return False
        time.sleep(0.1)  # polling the agent under a deadline: there is no event for "stuck"
    if child.poll() is not None or restarted_workers(child.pid, killed):
        return False
    print(
        f"launch: torchrun's agent (pid {child.pid}) neither exited nor restarted the ranks {grace_s:.0f} s after "
        "the watchdog ended them (blocked on the rendezvous store on node 0?); ended it (exit 1, retryable)",
        file=err or sys.stderr,
        flush=True,
    )
    pdeath.kill_tree(child.pid)
    return True


def restarted_workers(agent_pid: int, killed: Sequence[int]) -> list[int]:
    """The agent's live children other than the ranks the watchdog killed: the workers of a restart."""
    return [
        pid
        for pid in pdeath.descendants(agent_pid)
        if pdeath.parent_of(pid) == agent_pid and pid not in killed and ops_procs.state(pid) not in (None, "Z", "X")
    ]


def on_hang(child: subprocess.Popen, agent: bool) -> Callable[[watchdog.Verdict, Path, list[RankBeat]], None]:
    """What the hang watchdog (jobs/watchdog.py) does from its thread when no rank progressed: kill the
    ranks (torchrun restarts them while it may), then end torchrun's agent if it stays stuck."""

    def ended(verdict: watchdog.Verdict, folder: Path, beats: list[RankBeat]) -> None:
        killed = watchdog.kill_ranks(beats)
        if agent:  # a single worker is the child itself: killing it ended it
            end_stuck_agent(child, killed, AGENT_GRACE_S)

    return ended
