"""A live Slurm job's successor (backends/slurm/successor.py), without a cluster: the batch script's
`start` (one successor per job id across requeues; a successor goes on only when its predecessor was
lost, and then takes the run over), its `end` (the successor cancelled unless the job was requeued),
`cancel` (the successor first), `status` (a lost job's successor carries the run) and `--wait` (follows
it). Slurm's commands are replaced by a table of job states; the real cluster:
tests/engines/test_live_slurm.py."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from torchlaunch import contract, rundir, runlock
from torchlaunch.backends import Step
from torchlaunch.backends.slurm import cluster as slurm_cluster
from torchlaunch.backends.slurm import follow, operate
from torchlaunch.backends.slurm import successor as chain
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import record

SCRIPT_TEXT = "#!/bin/bash\nsrun true\n"


class Cluster:
    """Slurm as the successor module and the backend ask it: job states, sbatch, scancel, scontrol."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, next_id: int = 501) -> None:
        self.states: dict[str, str] = {}
        self.restarts: dict[str, str] = {}
        self.submitted: list[list[str]] = []
        self.envs: list[dict[str, str]] = []
        self.cancelled: list[str] = []
        self.next_id = next_id
        monkeypatch.setattr(slurm_cluster, "run", self.run)
        monkeypatch.setattr(chain, "squeue_state", lambda job: self.states.get(job, "UNKNOWN"))
        monkeypatch.setattr(chain, "final_state", lambda job: self.states.get(job, "UNKNOWN"))
        monkeypatch.setattr(operate, "controller_state", lambda job: self.states.get(job, "UNKNOWN"))
        monkeypatch.setattr(operate, "state", lambda job: self.states.get(job))
        monkeypatch.setattr(operate.slurm_proof, "slurm_job", lambda job, run_dir: None)

    def run(self, argv: Sequence[str], timeout_s: float = 0, env: dict[str, str] | None = None) -> slurm_cluster.Answer:
        argv = list(argv)
        if argv[0] == "sbatch":
            self.submitted.append(argv)
            self.envs.append(dict(env or {}))
            job = str(self.next_id)
            self.next_id += 1
            self.states[job] = "PENDING"
            return slurm_cluster.Answer(0, f"{job}\n", "")
        if argv[0] == "scancel":
            self.cancelled.append(argv[1])
            self.states[argv[1]] = "CANCELLED"
            return slurm_cluster.Answer(0, "", "")
        if argv[:3] == ["scontrol", "show", "job"]:
            job = argv[-1]
            return slurm_cluster.Answer(0, f"JobId={job} Restarts={self.restarts.get(job, '0')}\n", "")
        raise AssertionError(f"unexpected command {argv}")


def env_of(job: str, restart: int | None = None) -> dict[str, str]:
    env = {contract.SLURM_JOB_ID: job, "SLURM_CONF": "/etc/slurm.conf", "SLURM_NNODES": "2", "PATH": "/bin"}
    if restart is not None:
        env[contract.SLURM_RESTART_COUNT] = str(restart)
    return env


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "slurm_script"
    path.write_text(SCRIPT_TEXT)
    return str(path)


def test_what_slurm_is_asked() -> None:
    assert chain.sbatch_argv("500", "/spool/job500/slurm_script") == [
        "sbatch",
        "--parsable",
        "--dependency=afternotok:500",
        "--kill-on-invalid-dep=yes",
        "/spool/job500/slurm_script",
    ]
    # This job's SLURM_* must not reach the successor (its NNODES, restart count...); SLURM_CONF must.
    assert chain.submit_env(env_of("500", 1)) == {"SLURM_CONF": "/etc/slurm.conf", "PATH": "/bin"}


@pytest.mark.parametrize(
    ("recorded", "state", "cancelled", "went"),
    [
        (chain.Chain("500", launch="500-0"), "FAILED", False, True),  # the batch host lost
        (chain.Chain("500", launch="500-1"), "NODE_FAIL", False, True),
        (chain.Chain("500", launch="500-0", code=2), "FAILED", False, False),  # bad input: the run ended
        (chain.Chain("500", launch="500-0", code=1), "FAILED", False, False),  # the survivors failed
        (chain.Chain("500", launch="500-0"), "CANCELLED by 0", False, False),  # scancel, batch killed first
        (chain.Chain("500", launch="500-0"), "FAILED", True, False),  # launch cancel raced the record
        (chain.Chain("500", launch="500-0"), "TIMEOUT", False, False),
        (chain.Chain("500", launch="500-0"), "UNKNOWN", False, False),  # cannot tell: run nothing
        (None, "FAILED", False, False),
    ],
)
def test_a_successor_goes_on_only_after_a_lost_batch_host(
    recorded: chain.Chain | None, state: str, cancelled: bool, went: bool
) -> None:
    decided, why = chain.lost(recorded, state, cancelled)
    assert decided is went, why


def test_a_requeue_shows_in_the_restart_count() -> None:
    assert chain.requeued("1", "0") and chain.requeued("2", "1")
    assert not chain.requeued("1", "1") and not chain.requeued(None, "0") and not chain.requeued("x", "0")


def test_one_successor_per_job_id_across_requeues(
    tmp_path: Path, script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first allocation submits one; the requeued allocation (same job id) finds it waiting and submits
    none; once it is gone (cancelled by hand), the next allocation submits a new one."""
    cluster = Cluster(monkeypatch)
    run_dir = tmp_path / "run"
    (rundir.slurm(run_dir) / "500").mkdir(parents=True)
    (chain.pickle_path(run_dir, "500")).write_bytes(b"task")
    assert chain.start(str(run_dir), script, env_of("500")) == 0
    assert [argv[2] for argv in cluster.submitted] == ["--dependency=afternotok:500"]
    assert cluster.envs[0] == {"SLURM_CONF": "/etc/slurm.conf", "PATH": "/bin"}
    mine = chain.read(run_dir, "500")
    assert mine == chain.Chain("500", successor="501", launch="500-0")
    # The successor can start: its folder, its record naming this job, the task's pickle.
    assert chain.read(run_dir, "501") == chain.Chain("501", predecessor="500")
    assert chain.pickle_path(run_dir, "501").read_bytes() == b"task"
    assert chain.record_extra(run_dir, "500") == {"successor": "501"}

    assert chain.start(str(run_dir), script, env_of("500", 1)) == 0  # requeued: the same job id
    assert len(cluster.submitted) == 1
    assert "job 501 still waits behind job 500 (afternotok); none submitted" in capsys.readouterr().out
    assert chain.read(run_dir, "500") == chain.Chain("500", successor="501", launch="500-1")

    cluster.states["501"] = "CANCELLED"
    assert chain.start(str(run_dir), script, env_of("500", 2)) == 0
    assert len(cluster.submitted) == 2 and chain.read(run_dir, "500").successor == "502"


def test_a_refused_submission_leaves_the_job_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    Cluster(monkeypatch)
    refused = slurm_cluster.Answer(1, "", "sbatch: error: Batch job submission failed\n")
    monkeypatch.setattr(slurm_cluster, "run", lambda argv, timeout_s=0, env=None: refused)
    script = tmp_path / "s.sh"
    script.write_text(SCRIPT_TEXT)
    assert chain.start(str(tmp_path / "run"), str(script), env_of("500")) == 0
    out = capsys.readouterr().out
    assert "no successor submitted (sbatch: error: Batch job submission failed)" in out
    assert chain.read(tmp_path / "run", "500") == chain.Chain("500", launch="500-0")


def lost_predecessor(run_dir: Path, cluster: Cluster) -> None:
    """Job 500's allocation started (its record, the task's pickle, the run dir handed to it) and its
    successor 501 waits; then 500's batch host is lost: no end recorded, Slurm says FAILED."""
    (rundir.slurm(run_dir) / "500").mkdir(parents=True)
    chain.pickle_path(run_dir, "500").write_bytes(b"task with counters")
    lock = runlock.acquire(run_dir, command=["python", "-m", "launch.slurm"])
    lock.hand_over("slurm", "500")
    record.start(run_dir, scheduler="slurm", command=["python", "-m", "launch.slurm"], launch_id="500-0", job_id="500")
    chain.write(run_dir, chain.Chain("500", successor="501", launch="500-0"))
    chain.write(run_dir, chain.Chain("501", predecessor="500"))
    cluster.states.update({"500": "FAILED", "501": "RUNNING"})
    cluster.next_id = 502


@pytest.fixture
def lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Cluster]:
    """A run dir whose job 500 was lost while its successor 501 waited (lost_predecessor); the cluster."""
    cluster = Cluster(monkeypatch)
    lost_predecessor(tmp_path / "run", cluster)
    return tmp_path / "run", cluster


def test_the_successor_of_a_lost_job_takes_the_run_over(
    lost: tuple[Path, Cluster], script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, cluster = lost
    assert chain.start(str(run_dir), script, env_of("501")) == 0
    out = capsys.readouterr().out
    assert "job 500 was lost (its batch script ended without a word and Slurm says FAILED" in out
    assert "job 501 resumes the run from its newest checkpoint" in out
    assert chain.pickle_path(run_dir, "501").read_bytes() == b"task with counters"
    holder = runlock.read_holder(rundir.lock(run_dir))
    assert holder is not None and (holder.scheduler, holder.job_id) == ("slurm", "501")
    node0 = record.read_all(run_dir)[0][0]
    assert (node0.job_id, node0.launch_id, node0.extra["predecessor"]) == ("501", "501-0", "500")
    assert chain.read(run_dir, "501") == chain.Chain(
        "501", predecessor="500", successor="502", adopted=True, launch="501-0"
    )
    # Its requeue (the same job id) does not ask again and submits no second successor.
    assert chain.start(str(run_dir), script, env_of("501", 1)) == 0
    assert len(cluster.submitted) == 1


@pytest.mark.parametrize(
    ("ended", "state", "cancel", "why"),
    [
        (2, "FAILED", False, "its batch script ended with code 2"),
        (None, "CANCELLED by 0", False, "Slurm says CANCELLED by 0"),
        (None, "FAILED", True, "a cancel was asked for"),
    ],
)
def test_a_successor_whose_predecessor_was_not_lost_runs_nothing(
    lost: tuple[Path, Cluster],
    script: str,
    capsys: pytest.CaptureFixture[str],
    ended: int | None,
    state: str,
    cancel: bool,
    why: str,
) -> None:
    run_dir, cluster = lost
    chain.write(run_dir, chain.Chain("500", successor="501", launch="500-0", code=ended))
    cluster.states["500"] = state
    if cancel:
        record.request_cancel(run_dir, "500-0", "run")
    assert chain.start(str(run_dir), script, env_of("501")) == chain.NOTHING_TO_RESUME
    out = capsys.readouterr().out
    assert f"job 501 waited for job 500, which was not lost ({why}" in out
    assert cluster.submitted == [] and not chain.pickle_path(run_dir, "501").exists()
    holder = runlock.read_holder(rundir.lock(run_dir))
    assert holder is not None and holder.job_id == "500"


def test_a_successor_does_not_take_a_run_dir_another_live_job_holds(
    lost: tuple[Path, Cluster], script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run submitted again by hand after the loss owns the run dir: the successor leaves it alone."""
    run_dir, cluster = lost
    rundir.lock(run_dir).unlink()
    runlock.acquire(run_dir, command=["by", "hand"]).hand_over("slurm", "600")
    cluster.states["600"] = "RUNNING"
    monkeypatch.setattr(runlock, "flock_held", lambda path: False)
    monkeypatch.setattr("torchlaunch.backends.alive", lambda scheduler, job: cluster.states.get(job) == "RUNNING")
    assert chain.start(str(run_dir), script, env_of("501")) == chain.NOTHING_TO_RESUME
    assert "does not take the run over: run dir" in capsys.readouterr().out
    assert runlock.read_holder(rundir.lock(run_dir)).job_id == "600"  # type: ignore[union-attr]


@pytest.mark.parametrize(("code", "restarts", "cancelled"), [(0, "0", True), (2, "0", True), (75, "1", False)])
def test_a_batch_script_that_ends_decides_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, restarts: str, cancelled: bool
) -> None:
    """The code is recorded (a successor reads it), and the successor cancelled unless the job was
    requeued (rank 0's `scontrol requeue` after a preemption: slurmctld's restart count moved on)."""
    cluster = Cluster(monkeypatch)
    chain.write(tmp_path, chain.Chain("500", successor="501", launch="500-0"))
    cluster.states["501"] = "PENDING"
    cluster.restarts["500"] = restarts
    assert chain.end(str(tmp_path), code, env_of("500")) == 0
    assert cluster.cancelled == (["501"] if cancelled else [])
    assert chain.read(tmp_path, "500") == chain.Chain(
        "500", successor="501", launch="500-0", code=code, requeued=not cancelled
    )


def launch_record(job: str, successor: str | None) -> record.JobRecord:
    return record.JobRecord(
        launch_id=f"{job}-0", scheduler="slurm", job_id=job, extra={"successor": successor} if successor else {}
    )


def test_cancel_stops_the_successor_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's cancel must never start the successor: it is cancelled before the job (whose CANCELLED
    would meet afternotok); once the job has ended, the successor carrying the run is what is cancelled."""
    cluster = Cluster(monkeypatch)
    cluster.states.update({"500": "RUNNING", "501": "PENDING"})
    backend = operate.Slurm()
    assert backend.cancel(tmp_path, [launch_record("500", "501")]) == [
        Step("run", ("scancel", "501")),
        Step("run", ("scancel", "500")),
    ]
    # Recorded in the job's chain only (a node record written before the successor was submitted).
    chain.write(tmp_path, chain.Chain("500", successor="501", launch="500-0"))
    assert backend.cancel(tmp_path, [launch_record("500", None)])[0] == Step("run", ("scancel", "501"))
    cluster.states["500"] = "FAILED"
    assert backend.cancel(tmp_path, [launch_record("500", "501")]) == [Step("run", ("scancel", "501"))]
    cluster.states["501"] = "CANCELLED"  # nothing waits: the job alone, as before
    cluster.states["500"] = "RUNNING"
    assert backend.cancel(tmp_path, [launch_record("500", "501")]) == [Step("run", ("scancel", "500"))]


def test_cancel_refuses_a_successor_that_is_not_this_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(monkeypatch)
    cluster.states.update({"500": "RUNNING", "777": "PENDING"})
    monkeypatch.setattr(operate.slurm_proof, "slurm_job", lambda job, run_dir: None if job == "500" else "not ours")
    with pytest.raises(BadInput, match="Slurm job 777, recorded as job 500's successor, is not proven"):
        operate.Slurm().cancel(tmp_path, [launch_record("500", "777")])


def test_status_follows_a_lost_job_into_its_successor(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(monkeypatch)
    cluster.states.update({"500": "FAILED", "501": "PENDING"})
    said = operate.Slurm().state("500", {"successor": "501"})
    assert said is not None and said.word == "pending"
    assert said.said.startswith("FAILED for job 500; its successor job 501 is PENDING")
    cluster.states["501"] = "CANCELLED"  # the run ended with the job
    assert operate.Slurm().state("500", {"successor": "501"}).word == "failed"  # type: ignore[union-attr]
    assert operate.Slurm().state("500", {}).word == "failed"  # type: ignore[union-attr]


def test_status_names_the_successor_waiting_behind_a_running_job(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(monkeypatch)
    cluster.states.update({"500": "RUNNING", "501": "PENDING"})
    said = operate.Slurm().state("500", {"successor": "501"})
    assert said is not None and (said.word, said.said) == ("running", "RUNNING")  # the job is the one training
    assert said.note.startswith("successor job 501 is PENDING behind job 500: it resumes the run")
    cluster.states["500"] = "COMPLETED"  # the batch script cancels the successor; until then, the job's word alone
    assert operate.Slurm().state("500", {"successor": "501"}) == operate.job_word("COMPLETED")
    cluster.states.update({"500": "RUNNING", "501": "CANCELLED"})
    assert operate.Slurm().state("500", {"successor": "501"}) == operate.job_word("RUNNING")


class Job:
    def __init__(self, folder: Path, job_id: str) -> None:
        from submitit.core.utils import JobPaths

        self.job_id = job_id
        self.paths = JobPaths(folder / "%j", job_id=job_id)


def test_wait_follows_the_successor_of_a_lost_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`launch.slurm --wait` on job 500: it ends FAILED with its batch host, its successor 501 resumes
    and finishes; --wait prints both jobs' rank 0 output and exits with 501's outcome."""
    run_dir = tmp_path / "run"
    folder = rundir.slurm(run_dir)
    for job, text in (("500", "step 12\n"), ("501", "resumed from step 10\n")):
        (folder / job).mkdir(parents=True)
        (folder / job / f"{job}_0_log.out").write_text(text)
    chain.write(run_dir, chain.Chain("500", successor="501", launch="500-0"))
    states = {"500": "FAILED", "501": "COMPLETED"}
    monkeypatch.setattr(follow, "STATE_SOURCES", (lambda job: states[job],))
    out, err = io.StringIO(), io.StringIO()
    assert follow.follow(Job(folder, "500"), poll_s=0, out=out, err=err) == 0
    assert out.getvalue() == "step 12\nresumed from step 10\n"
    assert "job 500 lost its batch host (FAILED); following its successor job 501" in err.getvalue()
    # A job whose batch script recorded its end (bad input) is not followed into anything.
    chain.write(run_dir, chain.Chain("500", successor="501", launch="500-0", code=2))
    states["500"] = "FAILED"
    assert follow.successor_of(Job(folder, "500"), "FAILED") is None


def test_a_chain_record_is_untrusted_data(tmp_path: Path) -> None:
    path = chain.chain_path(tmp_path, "500")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"job": "500", "successor": "501; rm -rf /", "predecessor": 7, "code": "2"}))
    assert chain.read(tmp_path, "500") == chain.Chain("500")
    path.write_text("[1, 2]")
    assert chain.read(tmp_path, "500") is None
    assert chain.read(tmp_path, "../500") is None
    path.write_text(json.dumps({"job": "500", "successor": "\u0665\u0660\u0661"}))  # digits, not ASCII ones
    assert chain.read(tmp_path, "500") == chain.Chain("500")
    path.write_text(json.dumps({"job": "\u0665\u0660\u0660"}))
    assert chain.read(tmp_path, "500") is None
    path.write_bytes(b'{"job": "500", "successor": "\xff\xfe"}')  # not UTF-8
    assert chain.read(tmp_path, "500") in (None, chain.Chain("500"))


def test_end_leaves_a_successor_that_is_not_proven_this_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A forged chain.json naming a foreign job as the successor: the batch script's end step proves it
    as `launch cancel` does before any scancel, and leaves a job that is not this run's alone."""
    cluster = Cluster(monkeypatch)
    chain.write(tmp_path, chain.Chain("500", successor="777", launch="500-0"))
    cluster.states["777"] = "RUNNING"
    asked: list[tuple[str, str]] = []

    def not_ours(job: str, run_dir: str) -> str:
        asked.append((job, str(run_dir)))
        return "its output goes to /elsewhere/out"

    monkeypatch.setattr(operate.slurm_proof, "slurm_job", not_ours)
    assert chain.end(str(tmp_path), 0, env_of("500")) == 0
    assert cluster.cancelled == [] and asked == [("777", str(tmp_path))]
    assert "job 777 left alone: recorded as job 500's successor, but its output goes to" in capsys.readouterr().out
    assert chain.read(tmp_path, "500").code == 0  # type: ignore[union-attr]


def test_a_job_is_proven_by_its_own_folder_not_by_any_output_below_the_run_dir(tmp_path: Path) -> None:
    """Output in RUN_DIR/slurm/JOB/ (the folder launch.slurm gives the job, %j as squeue may print it) or
    the run's comment proves a job; output anywhere else below the run dir does not: a record forged in a
    parent folder of another run (or of a foreign job's output) would otherwise prove that run's jobs."""
    from torchlaunch.backends.slurm import proof

    parent = tmp_path / "runs"
    victim = parent / "victim"
    assert proof.proven("42", f"{parent}/slurm/42/42_0_log.out", "", parent) is None
    assert proof.proven("42", f"{parent}/slurm/%j/%j_0_log.out", "(null)", parent) is None
    assert proof.proven("42", "/elsewhere/out", proof.slurm_comment(parent), parent) is None
    for stdout in (
        f"{victim}/slurm/42/42_0_log.out",  # another run's live job, below a record forged in its parent
        f"{victim}/slurm/%j/%j_0_log.out",
        f"{parent}/foreign-42.out",  # a foreign `sbatch --wrap` job writing below the parent folder
        f"{parent}/slurm/43/43_0_log.out",  # another job's folder
        f"{parent}/slurm/42/../../x/42_0_log.out",
        "",
    ):
        why = proof.proven("42", stdout, "", parent)
        assert why is not None and f"not to {parent}/slurm/42/" in why, stdout
    assert proof.proven("42", f"{victim}/slurm/42/42_0_log.out", "", victim) is None  # its own run dir proves it
