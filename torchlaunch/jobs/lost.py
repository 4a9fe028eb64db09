"""Steps a stop lost: what a launch's ranks trained past the newest committed checkpoint, and its one line.

The one owner of "steps lost" for every launcher: launch.local after a stop whose checkpoint never
committed, a Slurm task at its own end, and, for an allocation that was killed (SIGKILL at the end of
Slurm's GraceTime leaves no process to say it), the next allocation at its start or `status` while the
requeued job waits for it. Steps trained are read from the ranks' heartbeats (torchlaunch.jobs.progress),
which the trainer flushes when a stop arrives.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.exit_codes import FAILURE, PREEMPTED
from torchlaunch.jobs import progress
from torchlaunch.jobs.record import JobRecord

Lost = tuple[int, int | None]
"""(steps lost, the step of the checkpoint they count from; None: no checkpoint)."""


def steps_lost(run_dir: Path, launch_id: str, said: int | None = None) -> Lost:
    """(steps this launch's ranks trained past the newest committed checkpoint, that checkpoint's step)
    after a stop: what a stop killed before its checkpoint committed lost. Read from the ranks' heartbeats
    of this launch (a lower bound: a beat may be a second behind) and `said`, the step a rank said it
    committed (status.note_committed), else the newest checkpoint that verifies. Why a rank's word first:
    verifying imports torch, 5-7 s on a loaded 2-core box, which docker stop's 10 s grace did not leave;
    and nothing is verified when this launch trained no step."""
    beats, _ = progress.read_all(progress.folder(run_dir))
    trained = max((b.step for b in beats if b.launch == launch_id and b.step is not None), default=0)
    if trained == 0:
        return 0, said
    step = said if said is not None else newest_step(run_dir)
    return max(0, trained - (step or 0)), step


def lost_by_stop(code: int, stopped: bool, run_dir: Path, launch_id: str, said: int | None) -> Lost:
    """What a launch that ended with `code` lost to a stop (`stopped`: it passed one on to its ranks).
    75 is a stop by definition; so is 1 after a stop: a window that ran out kills the ranks one by one,
    and a survivor may first fail on its killed peer's closed connection. Any other end lost nothing
    to a stop."""
    if code == PREEMPTED or (code == FAILURE and stopped):
        return steps_lost(run_dir, launch_id, said)
    return 0, None


def newest_step(run_dir: Path) -> int | None:
    """The step of the newest checkpoint that verifies (the store's latest_valid, which `status` shows
    too); imports torch, so only when some step was trained. A checkpoint folder that cannot be read
    counts as none: every step trained is then reported lost, never fewer."""
    root = rundir.checkpoints(run_dir)
    if not root.is_dir():
        return None
    try:
        from torchlaunch.core import checkpoint as ckpt

        path = ckpt.latest_valid(root)
    except (OSError, ValueError, ModuleNotFoundError):  # a Python without torch (`status`): none verified
        return None
    return ckpt.parse_step(path.name) if path is not None else None


def lost_line(lost: Lost, forwarded: Sequence[int] = (), stop: str = "", then: str = "") -> str:
    """The one line of a stop that lost steps (exit 1: README's exit codes). `stop` names the stop when
    it was not a signal this process saw (a Slurm allocation killed at the end of its grace); `then`,
    what comes next when it is not the user's rerun."""
    count, step = lost
    if not stop:
        stop = "stopped" + (f" after {signal.Signals(forwarded[0]).name}" if forwarded else "")
    since = f"checkpoint of step {step}" if step is not None else "beginning (no checkpoint)"
    then = then or "the same command again resumes from there"
    return f"{stop} before its checkpoint committed: at least {count} step(s) trained since the {since} are lost (exit 1); {then}"


def unrecorded(run_dir: Path, rec: JobRecord, then: str, newest: int | None = None) -> str:
    """The line for the allocation `rec`, which ended without recording an outcome (its processes were
    killed), when its ranks had trained past the newest checkpoint (`newest`'s step where the caller
    verified it already); '' when it lost nothing."""
    lost = steps_lost(run_dir, rec.launch_id, newest)
    if not lost[0]:
        return ""
    job = f" of job {rec.job_id}" if rec.job_id else ""
    killed = "ended without a word (killed: its grace, time limit or node ran out)"
    return lost_line(lost, stop=f"allocation {rec.launch_id}{job} {killed}", then=then)
