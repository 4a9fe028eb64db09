"""Each rank's outcome for the launcher that started it: one small JSON record per rank and attempt.

torchrun exits 1 whatever its workers returned, so launch.local cannot tell bad input (2) from a
preemption (75) by torchrun's code. Every program it starts (the built-in worker, the pre-flight, a
user's script) runs through torchlaunch.runner, which leaves `{code, reason, rank, finished}` in the
folder named by TORCHLAUNCH_STATUS_DIR under the launch's attempt id (TORCHLAUNCH_ATTEMPT_ID). Stdlib
only: the launcher and the torch-free program runner import it.

`finished` is the program's own word that the run is complete. Exit 0 alone cannot say it once a
preemption signal arrived: frameworks (Lightning, a handler ending in `sys.exit()`) end a signalled
run with 0 after saving, and a scheduler must then run the job again. So a program says it with
`declare_finished()` (torchlaunch.api's clean teardown does; the built-in worker's exit 0 counts as
saying it), and after a preemption signal the runner and launch.local turn an undeclared 0 into 75.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchlaunch import contract, rundir
from torchlaunch.base.files import read_json
from torchlaunch.exit_codes import BAD_INPUT

ATTEMPT_ENV = contract.ATTEMPT_ID
STATUS_DIR_ENV = contract.STATUS_DIR


def folder(run_dir: str | None = None) -> Path | None:
    """The status folder: the launcher's choice, else RUN_DIR/status (older launchers), else none."""
    chosen = contract.get(STATUS_DIR_ENV)
    if chosen:
        return Path(chosen)
    return rundir.status(run_dir) if run_dir else None


_finished_declared = False


def declare_finished() -> None:
    """The program's word that its run is complete (not merely that it exited 0): in the rank's process."""
    global _finished_declared
    _finished_declared = True


def finished_declared() -> bool:
    return _finished_declared


_committed: int | None = None


def note_committed(step: int) -> None:
    """The program's word that a checkpoint of `step` is durable (torchlaunch.api's teardown says it):
    what lets the launcher say "preempted with a committed checkpoint" of a run dir it does not know."""
    global _committed
    _committed = int(step)


def committed_step() -> int | None:
    return _committed


@dataclass(frozen=True)
class Record:
    """One rank's outcome as the launcher reads it."""

    rank: int
    code: int
    reason: str
    finished: bool
    """The program declared the run complete (see declare_finished)."""
    committed: int | None = None
    """The step of a checkpoint the program said it committed (see note_committed)."""
    when: float = 0.0
    """When the record was written (its file's mtime): the first failing rank is usually the cause."""


def launched() -> bool:
    """True under launch.local, which prints a bad-input reason once for all ranks."""
    return bool(contract.get(ATTEMPT_ENV))


def report(
    rank: int,
    code: int,
    reason: str,
    run_dir: str | None = None,
    *,
    finished: bool = False,
    committed: int | None = None,
) -> bool:
    """Leave this rank's outcome for the launcher that started us (no-op without one), and its last
    step in its heartbeat: `status`/`list` of an ended run show the step it ended at. False when the
    record could not be written (a full disk): the launcher will not find the reason to say it."""
    from torchlaunch.jobs import progress  # the heartbeat's owner; imported late (it reads the job files)

    progress.flush()
    attempt = contract.get(ATTEMPT_ENV)
    where = folder(run_dir)
    if not attempt or where is None:
        return True
    try:
        rundir.write_json(  # the launcher never sees half a record
            where / f"{attempt}-rank{rank}.json",
            {"code": code, "reason": reason, "rank": rank, "finished": finished, "committed": committed},
            durable=False,
            sort_keys=False,
            real_folder=True,  # a link planted in status/'s place while the run ran is not followed
        )
    except OSError:
        return False
    return True


def earlier_bad_input(run_dir: str | None = None) -> str | None:
    """After a torchrun restart within the same launch: the reason a rank already found bad input
    (a rerun would fail the same way, so the restarted group stops at once), else None."""
    attempt = contract.get(ATTEMPT_ENV)
    where = folder(run_dir)
    if not attempt or where is None or contract.restart_count() == 0:
        return None
    for f in sorted(where.glob(f"{attempt}-rank*.json")):
        record, _ = read_json(f)  # never blocks on a FIFO left under a record's name
        if record is None:
            continue
        if record.get("code") == BAD_INPUT:
            return str(record.get("reason", "bad input"))
    return None


def peer_bad_input(me: int, run_dir: str | None = None) -> tuple[int, str] | None:
    """(rank, reason) of another rank of this attempt that already reported bad input, else None.

    A rank that finds bad input reports it before it exits; its peers then fail in their next
    collective ("Connection closed by peer"), a consequence, not a second problem worth a traceback."""
    attempt = contract.get(ATTEMPT_ENV)
    where = folder(run_dir)
    if not attempt or where is None:
        return None
    for f in sorted(where.glob(f"{attempt}-rank*.json")):
        record, _ = read_json(f)
        if record is None:
            continue
        try:
            rank = int(record.get("rank", -1))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if record.get("code") == BAD_INPUT and rank != me:
            return rank, str(record.get("reason", "bad input"))
    return None


def records(where: Path, attempt: str) -> list[Record]:
    """The launcher's side: this attempt's records, which are consumed."""
    found = []
    for f in sorted(where.glob(f"{attempt}-rank*.json")):
        try:
            data, _ = read_json(f)
            if data is None:
                continue
            found.append(
                Record(
                    int(data.get("rank", 0)),
                    int(data["code"]),
                    str(data.get("reason", "")),
                    data.get("finished") is True,
                    data["committed"] if isinstance(data.get("committed"), int) else None,
                    f.stat().st_mtime,
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        finally:
            f.unlink(missing_ok=True)
    return found


def first_failure(found: list[Record]) -> Record | None:
    """The earliest record of a rank that failed (exit 1 or a crash code): the one that explains a
    failed launch, its peers usually failing after it ("Connection closed by peer")."""
    failed = [r for r in found if r.code not in (0, BAD_INPUT, 75)]
    return min(failed, key=lambda r: (r.when, r.rank)) if failed else None


def collect(where: Path, attempt: str) -> tuple[list[int], list[str]]:
    """Codes and reasons of this attempt's records (consumed)."""
    found = records(where, attempt)
    return [r.code for r in found], [r.reason for r in found]
