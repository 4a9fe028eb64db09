"""The node's one exit code and its one line: the child's code and the ranks' reports combined
(exit_codes.node_code), a stop that lost steps (jobs/lost.py), and what a preemption committed.

Why the agent combines them: torchrun exits 1 whatever its workers returned, and schedulers must tell
bad input (2, never retried), a preemption (75, run again) and a failure (1) apart.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from torchlaunch import exit_codes, rundir, status
from torchlaunch import runner as program_mod
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED
from torchlaunch.jobs.launcher import Operation
from torchlaunch.jobs.lost import lost_by_stop, lost_line
from torchlaunch.launch.relay import StderrRelay


class LaunchEnded(Exception):
    """The launch ends before its ranks start, with `code` and one line (a stop, no first group)."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code, self.line = code, line


combine_exit_codes = exit_codes.node_code


def read_worker_codes(run_dir: Path, attempt: str) -> tuple[list[int], list[str]]:
    """The built-in worker's reports, left in RUN_DIR/status/ (consumed)."""
    return status.collect(rundir.status(run_dir), attempt)


def new_checkpoint(run_dir: Path | None, since: float) -> tuple[int | None, bool]:
    """(newest valid checkpoint's step, whether it was committed since `since`) of a built-in run dir;
    read only after an exit 75 (it imports torch to verify the checkpoint)."""
    if run_dir is None:
        return None, False
    from torchlaunch.jobs import gather

    found, _ = gather.newest_checkpoint(run_dir)
    if found is None:
        return None, False
    return found.step, found.committed is not None and found.committed >= since


def preempted_line(
    found: Sequence[status.Record],
    forwarded: Sequence[int],
    step: int | None,
    new: bool,
    run_dir: Path | None,
) -> str:
    """What an exit 75 means, saying only what is known: a committed checkpoint is claimed only where
    this launcher sees one committed during this launch (the built-in worker's run dir) or the program
    said it committed one (status.note_committed: torchlaunch.api)."""
    by = f" after {signal.Signals(forwarded[0]).name}" if forwarded else ""
    said = [r.committed for r in found if r.committed is not None]
    if run_dir is None and said:
        step, new = max(said), True
    if new:
        return (
            f"preempted with a committed checkpoint (exit 75) at step {step}{by}; run the same command again to resume"
        )
    if run_dir is not None:
        since = f"step {step}" if step is not None else "the beginning"
        return f"exit 75{by} without a new checkpoint in {run_dir}; the same command again restarts from {since}"
    stopped = next((r.reason for r in found if program_mod.stopped_by_runner(r.reason)), None)
    if stopped is not None:  # the runner's own handler stopped a program that had none (runner.SignalOwner)
        return f"preempted{by}: {stopped}"
    if any("without declaring" in r.reason for r in found):
        return (
            f"preempted{by}: the program ended without declaring the run finished (exit 75); run the same "
            "command again to resume from the program's own checkpoint"
        )
    return f"preempted{by}: the program exited 75; run the same command again to resume from its own checkpoint"


def report(
    child_code: int,
    status_folder: Path,
    attempt: str,
    forwarded: Sequence[int],
    *,
    interrupted: bool,
    label: str,
    ranks: int | None,
    op: Operation | None,
    what: str,
    run_dir: Path | None,
    started: float,
    relay: StderrRelay,
) -> int:
    """The node's one exit code from its child's and its ranks' reports (`forwarded`: the stop signals
    this launcher passed on), recorded in the job record (`op`) and said in one line where it is not 0."""
    if interrupted:
        reason = f"second Ctrl-C: {what} and its ranks ended at once, without a checkpoint"
        # A person stopped the run for good: cancelled (3), never the retryable 1 or the requeued 75.
        code = op.finish(exit_codes.CANCELLED, reason) if op is not None else exit_codes.CANCELLED
        print(
            f"launch: {reason} (exit {code}); the same command resumes from the newest committed one", file=sys.stderr
        )
        return code
    found = status.records(status_folder, attempt)
    codes = [r.code for r in found]
    code = combine_exit_codes(child_code, codes, ranks, signalled=bool(forwarded), records=found)
    reason = next((r.reason for r in found if r.code == code and code != OK), "")
    lost = (0, None)
    said = max((r.committed for r in found if r.committed is not None), default=None)
    if op is not None and run_dir is not None:
        lost = lost_by_stop(code, bool(forwarded), run_dir, op.launch_id, said)
        if lost[0]:  # 75 says "nothing lost, run it again"; this stop lost steps: a failure, honestly
            code = FAILURE
            reason = lost_line(lost, forwarded)
    if op is not None:
        code = op.finish(code, reason)
    if code == OK and child_code != 0:
        print(
            f"launch: every rank reported a finish; exit {child_code} came from a rank's teardown after it (ignored)",
            file=sys.stderr,
        )
    if code == BAD_INPUT:
        reason = next((r.reason for r in found if r.code == BAD_INPUT), "bad input")
        print(f"launch: workers stopped on bad input (exit 2, not retried): {reason}", file=sys.stderr)
    elif code == PREEMPTED:  # a rank's word that it committed, else what verifies (the marker's mtime)
        step, new = (said, True) if said is not None else new_checkpoint(run_dir, started - 1.0)
        print(f"launch: {preempted_line(found, forwarded, step, new, run_dir)}", file=sys.stderr)
    elif code == exit_codes.CANCELLED:
        step, _ = new_checkpoint(run_dir, started - 1.0)
        at = f" (newest checkpoint: step {step})" if step is not None else ""
        print(f"launch: cancelled (exit {code}, never requeued){at}; the same command resumes", file=sys.stderr)
    elif code == FAILURE and lost[0]:
        print(f"launch: {lost_line(lost, forwarded)}", file=sys.stderr)
    elif code == FAILURE:
        first = status.first_failure(found)
        if first is None or ranks is None or len(found) < ranks:
            relay.release_held()  # a rank left no word (killed, crashed hard): torchrun's report names it
        cause = f": rank {first.rank}: {first.reason.split(' failed: ', 1)[-1]}" if first and first.reason else ""
        print(
            f"launch: {label} failed{cause} ({what} exit {child_code}, worker codes {sorted(set(codes)) or 'none'})",
            file=sys.stderr,
        )
    return code
