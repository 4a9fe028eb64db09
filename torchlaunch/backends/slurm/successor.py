"""A live Slurm job's replacement allocation: a successor job that resumes the run if the batch host is lost.

    python -m launch.slurm --nodes 1-2 ... recovery.live=true recovery.lighthouse=http://HOST:29510

A live job survives the loss of any node but the first: the batch script runs there, and when it dies
with its node Slurm ends the job (FAILED with --no-kill, never requeued), whatever the ranks left could
do. So each allocation of a live job's batch script, before its srun, makes sure one successor job waits
behind it: the same script, submitted with `sbatch --dependency=afternotok:JOB --kill-on-invalid-dep=yes`.
What Slurm 22.05 does with it, measured on the dev cluster (docs/SLURM.md "Live recovery"):

- the job ends COMPLETED: the successor's dependency can never be met and Slurm cancels it;
- the job is requeued (`scontrol requeue` after a preemption or a stop below --nodes MIN's minimum, a
  preemption by a higher partition): the dependency stays unfulfilled through the requeue;
- the job ends FAILED or NODE_FAIL (its batch host lost), CANCELLED, or with any non-zero code (bad
  input, a failure): afternotok is met and the successor starts.

Only the first of the last group is a loss. So two guards keep a successor to the batch host's loss:

1. The batch script that lives to its end records its code (`end`, from the srun wrapper) and cancels its
   successor unless its job was requeued: the run ends with that code, as it did before. The record is only
   a claim (anyone who can write the run dir can name any job): the successor is scancelled only once Slurm
   says it is this run's (backends.slurm.proof, as `launch cancel`).
2. The successor's first act (`start`, before its srun) reads its predecessor's record and Slurm's word
   for it, and goes on only when the predecessor was lost (`lost`: its batch script never recorded an
   end, and Slurm says FAILED or NODE_FAIL, and no cancel was asked for); otherwise it exits 0 at once,
   saying why. A user's `scancel` of the job (the batch script killed after KillWait before its end)
   reads CANCELLED; `python -m launch cancel` cancels the successor first (operate.Slurm.cancel) and
   its request names the predecessor's launch.

A successor that goes on takes the run over as a submission would (the run dir's lock from its
predecessor, the job record, submitit's pickle with the task's counters, which its srun loads), then
waits behind a successor of its own, and its ranks resume from the newest committed checkpoint, as after
a preemption. The records, one per job, `RUN_DIR/slurm/JOB/chain.json` (rundir's atomic writes): the
job's predecessor and successor, whether it took the run over, and the last allocation's batch script:
its launch id and, once it ended, its code. A requeued job finds its successor there and submits no
second one while that one waits (at most one per job id).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from torchlaunch import contract, rundir
from torchlaunch.backends.slurm import cluster
from torchlaunch.base import files
from torchlaunch.base.untrusted import whole

CHAIN_FILE = "chain.json"
NOTHING_TO_RESUME = 100
"""`start`'s exit code that ends the batch script at once with 0 (a successor whose predecessor was not
lost); any other code lets the script go on to its srun."""
LOST_STATES = ("FAILED", "NODE_FAIL")
"""Slurm's end states of a job whose batch host was lost (measured: FAILED; NODE_FAIL when slurmctld
ends the job for its node first). CANCELLED, TIMEOUT, PREEMPTED, OUT_OF_MEMORY and COMPLETED are not."""
DEPENDENCY = "afternotok"
PREFIX = "slurm successor: "
KEEP_ENV = ("SLURM_CONF",)
"""The only SLURM_* variable the successor's sbatch keeps: the others are this job's, and a job started
later with them in its environment would read another allocation's ids, counts and restart count."""


@dataclass(frozen=True)
class Chain:
    """One job's record (RUN_DIR/slurm/JOB/chain.json)."""

    job: str
    predecessor: str | None = None
    successor: str | None = None
    adopted: bool = False
    """A successor that found its predecessor lost and took the run over."""
    launch: str | None = None
    """The allocation (JOB-RESTARTS) whose batch script wrote last."""
    code: int | None = None
    """That batch script's code once it ended; None while it runs, and for good when it was lost."""
    requeued: bool = False
    """The batch script ended with the job requeued (the successor keeps waiting)."""

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Chain | None:
        job = files.as_str(data.get("job"), 64)
        if not job or whole(job, 20) is None:
            return None

        def job_id(key: str) -> str | None:  # ASCII digits only: a job id goes into scancel's argv
            value = files.as_str(data.get(key), 64)
            return value if value and whole(value, 20) is not None else None

        return cls(
            job=job,
            predecessor=job_id("predecessor"),
            successor=job_id("successor"),
            adopted=data.get("adopted") is True,
            launch=files.as_str(data.get("launch"), 80),
            code=files.as_int(data.get("code"), 0, 255),
            requeued=data.get("requeued") is True,
        )


def chain_path(run_dir: str | os.PathLike[str], job: str) -> Path:
    return rundir.slurm(run_dir) / job / CHAIN_FILE


def read(run_dir: str | os.PathLike[str], job: str) -> Chain | None:
    """The job's record, or None (none written, or not one of ours)."""
    if whole(job, 20) is None:
        return None
    data, _ = files.read_json(chain_path(run_dir, job))
    return Chain.from_json(data) if data is not None else None


def write(run_dir: str | os.PathLike[str], chain: Chain) -> None:
    rundir.write_json(chain_path(run_dir, chain.job), asdict(chain), indent=1, newline=True)


# ---- pure decisions --------------------------------------------------------------------------------


def sbatch_argv(job: str, script: str) -> list[str]:
    """The successor's submission: the same batch script, started by Slurm only if `job` ends not OK
    (pure). --kill-on-invalid-dep: a job that completes cancels it, instead of leaving it pending."""
    return ["sbatch", "--parsable", f"--dependency={DEPENDENCY}:{job}", "--kill-on-invalid-dep=yes", script]


def submit_env(env: Mapping[str, str]) -> dict[str, str]:
    """The successor's sbatch environment (sbatch exports it to the job): this one without this job's
    own SLURM_* variables (pure)."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k in KEEP_ENV}


def lost(chain: Chain | None, state: str, cancelled: bool) -> tuple[bool, str]:
    """Whether the predecessor `chain` was lost with its batch host, and why (pure): its batch script never
    recorded an end, Slurm ended the job FAILED or NODE_FAIL, and nobody asked for a cancel. `state` is
    Slurm's word for the job ("CANCELLED by 0" -> CANCELLED; UNKNOWN when it cannot say)."""
    if chain is None:
        return False, "no record of the job (it never started its batch script here)"
    if chain.code is not None:
        return False, f"its batch script ended with code {chain.code}: the run ended there"
    if cancelled:
        return False, "a cancel was asked for (python -m launch cancel)"
    word = state.split()[0] if state.strip() else "UNKNOWN"
    if word not in LOST_STATES:
        return False, f"Slurm says {state.strip() or 'nothing'}, not a lost batch host"
    return True, f"its batch script ended without a word and Slurm says {word}: its batch host was lost"


def live_successor(chain: Chain | None, state_of: Mapping[str, str]) -> str | None:
    """The successor recorded for the job while it still waits or runs (pure: `state_of` is Slurm's word
    for it, squeue's). None: none recorded, or it ended (cancelled, or Slurm dropped it): a new one is due."""
    if chain is None or chain.successor is None:
        return None
    state = state_of.get(chain.successor, "UNKNOWN").split()
    word = state[0] if state else "UNKNOWN"
    return chain.successor if word in WAITING_STATES else None


WAITING_STATES = ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED")


def requeued(restarts_now: str | None, restarts_before: str) -> bool:
    """Whether this job was requeued during this allocation (pure): slurmctld's restart count for it is
    past the allocation's own (SLURM_RESTART_COUNT, absent before a first requeue)."""
    try:
        return restarts_now is not None and int(restarts_now) > int(restarts_before or 0)
    except ValueError:
        return False


# ---- the cluster -----------------------------------------------------------------------------------


def squeue_state(job: str) -> str:
    """slurmctld's state of the job (UNKNOWN when it cannot say or no longer knows the job)."""
    return cluster.controller_state(job)


def final_state(job: str) -> str:
    """The job's end as slurmctld remembers it, else accounting's (UNKNOWN when neither says)."""
    said = cluster.scontrol_state(job)
    return said if said != "UNKNOWN" else cluster.job_state(job)


def restarts(job: str) -> str | None:
    """slurmctld's restart count of the job (`scontrol show job`), None when it cannot say."""
    return (cluster.job_fields(job) or {}).get("Restarts")


def pickle_path(run_dir: str | os.PathLike[str], job: str) -> Path:
    """submitit's pickle of the task that a job's srun loads (RUN_DIR/slurm/JOB/JOB_submitted.pkl)."""
    return rundir.slurm(run_dir) / job / f"{job}_submitted.pkl"


def copy_pickle(run_dir: str | os.PathLike[str], source: str, target: str) -> bool:
    """The task's pickle of job `source` (its counters as its last allocation left them) for job `target`."""
    try:
        data = pickle_path(run_dir, source).read_bytes()
    except OSError:
        return False
    rundir.write_bytes(pickle_path(run_dir, target), data)
    return True


def submit(run_dir: str | os.PathLike[str], job: str, script: str, env: Mapping[str, str]) -> str:
    """Submit the successor of `job` (sbatch_argv, from this job's environment `env`) and make it
    startable: its folder (Slurm opens its log files there), its record naming `job`, and the task's
    pickle. Its job id; RuntimeError when sbatch refuses."""
    successor = cluster.sbatch(sbatch_argv(job, script), submit_env(env))
    (rundir.slurm(run_dir) / successor).mkdir(parents=True, exist_ok=True)
    write(run_dir, Chain(job=successor, predecessor=job))
    copy_pickle(run_dir, job, successor)
    return successor


def cancel_asked(run_dir: str | os.PathLike[str], job: str) -> bool:
    """`python -m launch cancel` named a launch of `job` (its request names the launch it stopped)."""
    from torchlaunch.jobs import record

    launch, _ = record.cancel_request(run_dir)
    return launch is not None and launch.split("-")[0] == job


SUCCESSOR_KEY = "successor"
"""The job record's extra key (jobs.record.JobRecord.extra) naming the job's waiting successor: `status`
follows a lost job into it and `cancel` cancels it first (operate.Slurm)."""
PREDECESSOR_KEY = "predecessor"


def record_extra(run_dir: str | os.PathLike[str], job: str) -> dict[str, str]:
    """What a task adds to its node's job record: the successor waiting behind the job, and the job it
    took the run over from (the batch script's `start` wrote both before srun)."""
    mine = read(run_dir, job)
    if mine is None:
        return {}
    out = {SUCCESSOR_KEY: mine.successor} if mine.successor else {}
    if mine.adopted and mine.predecessor:
        out[PREDECESSOR_KEY] = mine.predecessor
    return out


# ---- the batch script's two calls --------------------------------------------------------------------


def adopt(run_dir: str, job: str, predecessor: str) -> str | None:
    """Take the run over from a lost predecessor: the run dir's lock (refused while another live job holds
    it: a submission by hand since), the job record (`status` names this job at once) and the task's
    pickle. None when done, else why not."""
    from torchlaunch import backends, runlock
    from torchlaunch.exit_codes import BadInput
    from torchlaunch.jobs import record

    if not copy_pickle(run_dir, predecessor, job) and not pickle_path(run_dir, job).exists():
        return f"job {predecessor} left no task to run ({pickle_path(run_dir, predecessor)} is missing)"
    records, _ = record.read_all(run_dir)
    before = next((r for r in records if r.job_id == predecessor and r.node_rank == 0), None)
    command = list(before.command) if before is not None else []

    def holds(scheduler: str, job_id: str) -> bool:
        return job_id != predecessor and backends.alive(scheduler, job_id)

    try:
        lock = runlock.acquire(run_dir, command=command, scheduler="slurm", job_id=job, job_alive=holds)
    except BadInput as refused:
        return str(refused).removeprefix("launch error: ")
    lock.hand_over("slurm", job)
    record.start(
        run_dir,
        scheduler="slurm",
        command=command,
        launch_id=f"{job}-0",
        job_id=job,
        nnodes=before.nnodes if before is not None else 1,
        local_ranks=before.local_ranks if before is not None else None,
        extra={PREDECESSOR_KEY: predecessor},
    )
    return None


def start(run_dir: str, script: str, env: Mapping[str, str] | None = None) -> int:
    """Before this allocation's srun: a successor whose predecessor was not lost ends here
    (NOTHING_TO_RESUME); one whose predecessor was lost takes the run over; then, every allocation, one
    successor waits behind this job. A failure of that submission is one line: the run goes on without."""
    env = os.environ if env is None else env
    job = env.get(contract.SLURM_JOB_ID, "")
    if whole(job, 20) is None:
        print(f"{PREFIX}not in a Slurm job (SLURM_JOB_ID unset): no successor", flush=True)
        return 0
    restart = env.get(contract.SLURM_RESTART_COUNT) or "0"
    mine = read(run_dir, job) or Chain(job=job)
    if mine.predecessor is not None and not mine.adopted:
        before = mine.predecessor
        went, why = lost(read(run_dir, before), final_state(before), cancel_asked(run_dir, before))
        if not went:
            print(
                f"{PREFIX}job {job} waited for job {before}, which was not lost ({why}): nothing to resume", flush=True
            )
            return NOTHING_TO_RESUME
        refused = adopt(run_dir, job, before)
        if refused is not None:
            print(f"{PREFIX}job {before} was lost, but job {job} does not take the run over: {refused}", flush=True)
            return NOTHING_TO_RESUME
        print(
            f"{PREFIX}job {before} was lost ({why}); job {job} resumes the run from its newest checkpoint", flush=True
        )
        mine = replace(mine, adopted=True)
    mine = replace(mine, launch=f"{job}-{restart}", code=None, requeued=False)
    write(run_dir, mine)  # this allocation runs: a successor that starts while no end is recorded finds it lost
    waiting = live_successor(mine, {mine.successor: squeue_state(mine.successor)} if mine.successor else {})
    if waiting is not None:
        print(f"{PREFIX}job {waiting} still waits behind job {job} ({DEPENDENCY}); none submitted", flush=True)
    elif not os.path.isfile(script):
        print(
            f"{PREFIX}no successor submitted ({script} is not this job's batch script): losing the first node ends the run",
            flush=True,
        )
    else:
        try:
            waiting = submit(run_dir, job, script, env)
            print(
                f"{PREFIX}job {waiting} waits behind job {job} ({DEPENDENCY}): it resumes the run if this job's "
                "batch host is lost",
                flush=True,
            )
        except (OSError, RuntimeError) as error:
            print(f"{PREFIX}no successor submitted ({error}): losing the first node ends the run", flush=True)
            waiting = None
    write(run_dir, replace(mine, successor=waiting))
    return 0


def end(run_dir: str, code: int, env: Mapping[str, str] | None = None) -> int:
    """After this allocation's srun (its code, the verdict's): recorded, and the successor cancelled unless
    the job was requeued: a batch script that lives to its end decides the run's outcome itself."""
    env = os.environ if env is None else env
    job = env.get(contract.SLURM_JOB_ID, "")
    if whole(job, 20) is None:
        return 0
    mine = read(run_dir, job) or Chain(job=job)
    again = code != 0 and requeued(restarts(job), env.get(contract.SLURM_RESTART_COUNT) or "0")
    write(
        run_dir, replace(mine, launch=f"{job}-{env.get(contract.SLURM_RESTART_COUNT) or 0}", code=code, requeued=again)
    )
    if mine.successor is None or again:
        return 0
    from torchlaunch.backends.slurm import proof

    why = proof.slurm_job(mine.successor, run_dir)  # the record is a claim: prove it as `launch cancel` does
    if why is not None:
        print(f"{PREFIX}job {mine.successor} left alone: recorded as job {job}'s successor, but {why}", flush=True)
        return 0
    if cluster.scancel(mine.successor):
        ended = "finished" if code == 0 else f"ended with code {code}, its batch host alive"
        print(f"{PREFIX}job {mine.successor} cancelled: job {job} {ended}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchlaunch.backends.slurm.successor")
    parser.add_argument("--run-dir", required=True)
    sub = parser.add_subparsers(dest="command", required=True)
    first = sub.add_parser("start", help="before srun: the guard, the take-over and this job's successor")
    first.add_argument("--script", required=True, help="this batch script ($0), submitted again as the successor")
    last = sub.add_parser("end", help="after srun: record the code; cancel the successor unless requeued")
    last.add_argument("--code", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            return start(args.run_dir, args.script)
        return end(args.run_dir, args.code)
    except Exception as error:  # noqa: BLE001 - a safety net must never end the job it guards
        job = os.environ.get(contract.SLURM_JOB_ID, "")
        mine = read(args.run_dir, job)
        if args.command == "start" and mine is not None and mine.predecessor is not None and not mine.adopted:
            print(f"{PREFIX}start failed ({type(error).__name__}: {error}); nothing resumed", flush=True)
            return NOTHING_TO_RESUME  # a successor that could not check its predecessor runs nothing
        print(f"{PREFIX}{args.command} failed ({type(error).__name__}: {error}); the job goes on", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
