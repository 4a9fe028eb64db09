"""What a node's launcher does to make its job operable, in one object: record who runs the job, give
the ranks the heartbeat and log folders, watch for a hang, and record how the launch ended.

    op = Operation(run_dir, scheduler="local", command=sys.argv, launch_id=attempt, local_ranks=4)
    env.update(op.rank_env())
    op.start(on_hang=lambda verdict, folder, beats: watchdog.kill_ranks(beats))  # torchrun restarts them
    code = op.finish(code)          # hung -> 1 (retryable), cancelled -> 3 (exit_codes.CANCELLED)

And in each rank, before its program runs: `prepare_rank()` (stack-dump handler + log tee).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from torchlaunch import contract, exit_codes, rundir
from torchlaunch.base import storage
from torchlaunch.exit_codes import BAD_INPUT, OK
from torchlaunch.jobs import progress, proof, ranklog, record, schedulers, watchdog

OnHang = Callable[[watchdog.Verdict, Path, list[progress.RankBeat]], None]
"""Called from the watchdog's thread after the dump: end the hung ranks (watchdog.kill_ranks)."""

LOGS_DIR_ENV = contract.LOGS_DIR


outcome_of = exit_codes.outcome_of
exit_code_of = exit_codes.launch_code


class Operation:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        scheduler: str,
        command: Sequence[str],
        launch_id: str,
        job_id: str | None = None,
        node_rank: int = 0,
        nnodes: int = 1,
        local_ranks: int | None = None,
        hang_timeout: float | None = None,
        console: ranklog.Console | None = None,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.console = console or ranklog.Console()
        self.launch_id = launch_id
        self._args = dict(
            scheduler=scheduler,
            command=list(command),
            launch_id=launch_id,
            job_id=job_id,
            node_rank=node_rank,
            nnodes=nnodes,
            local_ranks=local_ranks,
            extra=extra,
        )
        self.token = proof.new_token()
        """In the ranks' environment, its digest in the record: what lets `cancel` prove this launcher."""
        self.hang_timeout = hang_timeout
        self.record: record.JobRecord | None = None
        self.dog: watchdog.Watchdog | None = None
        self.hung: watchdog.Verdict | None = None

    def rank_env(self) -> dict[str, str]:
        """What every rank of this node needs in its environment (with TORCHLAUNCH_ATTEMPT_ID)."""
        return {
            progress.PROGRESS_DIR_ENV: str(progress.folder(self.run_dir).absolute()),
            LOGS_DIR_ENV: str(ranklog.folder(self.run_dir).absolute()),
            progress.LAUNCH_ENV: self.launch_id,
            proof.TOKEN_ENV: self.token,
            **self.console.env(),
        }

    def start(self, on_hang: OnHang | None = None) -> record.JobRecord:
        """Record the launch; with `on_hang` (usually watchdog.kill_ranks), watch the node's ranks. The job
        is bound to the run dir (the scheduler's claim, which lets `cancel` prove the job is this run's)
        before the record names it: a `cancel` that finds the record can then prove the job at once."""
        backend, job_id = schedulers.get(str(self._args["scheduler"])), self._args["job_id"]
        if backend is not None and job_id and self._args["node_rank"] == 0:
            backend.claim(str(job_id), self.run_dir)
        self.record = record.start(self.run_dir, **self._args, token=self.token)  # type: ignore[arg-type]
        if on_hang is not None and self.hang_timeout != 0:

            def hung(verdict: watchdog.Verdict, folder: Path, beats: list[progress.RankBeat]) -> None:
                self.hung = verdict
                on_hang(verdict, folder, beats)

            poll_s = min(5.0, self.hang_timeout / 4) if self.hang_timeout else 5.0
            self.dog = watchdog.Watchdog(self.run_dir, self.launch_id, option_s=self.hang_timeout, poll_s=poll_s)
            self.dog.start(hung)
        return self.record

    def finish(self, code: int, reason: str = "", recorded: bool = True) -> int:
        """Stop watching, record the outcome (not when `recorded` is False: a node left out of the live
        group that trained, whose outcome is not the run's: backends/slurm/task.py), return the exit code
        the launcher should end with."""
        if self.dog is not None:
            self.dog.stop()
        job = (self._args.get("extra") or {}).get(record.ELASTIC_JOB)
        cancelled = record.cancel_requested(self.run_dir, self.launch_id, job)
        hung = self.hung is not None and code not in (OK, BAD_INPUT)  # a restart after a hang may still finish
        outcome = outcome_of(code, cancelled=cancelled, hung=hung)
        if hung and self.hung is not None:
            reason = f"hang: {self.hung.reason}; stalled ranks {', '.join(map(str, self.hung.stalled))}"
        final = exit_code_of(outcome, code)
        if self.record is not None and recorded:
            try:
                self.record = record.finish(self.run_dir, self.record, code, outcome, reason)
            except OSError as error:  # the run dir filled up, went read-only or got a link planted during the run
                linked = isinstance(error, rundir.LinkedFolder)
                if not (linked or storage.is_storage(error)):
                    raise
                where = record.record_path(self.run_dir, self.record.node_rank)
                line = error.strerror if linked else storage.describe(error, where, "job record")
                print(f"launch: outcome {outcome} (exit {final}) not recorded: {line}", file=sys.stderr, flush=True)
        return final


_prepared_in: int | None = None
"""The pid that ran prepare_rank: a Slurm task prepares itself, then runs the runner, which would again."""


def prepare_rank() -> None:
    """In each rank before its program: the stack-dump handler and the per-rank log (no-op without a
    launcher). Once per process: a second tee would write every line twice and prefix it twice."""
    global _prepared_in
    if _prepared_in == os.getpid():
        return
    _prepared_in = os.getpid()
    progress.register_stack_dump()
    logs = contract.get(LOGS_DIR_ENV)
    if logs:
        rank = contract.rank()
        ranklog.start_tee(Path(logs) / f"rank-{rank}.log", rank, ranklog.Console.from_env())
