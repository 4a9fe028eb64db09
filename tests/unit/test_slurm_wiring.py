"""launch.slurm carries user text only through launch.emit, owns the run dir through runlock and hands it to
the job, ends `--wait` when any state source says the job is over, and shows the failing task's stderr."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import pytest

from torchlaunch import runlock
from torchlaunch.backends.slurm import cluster as slurm_cluster
from torchlaunch.backends.slurm import follow as slurm_follow
from torchlaunch.backends.slurm import launch as slurm
from torchlaunch.backends.slurm import operate as slurm_backend
from torchlaunch.backends.slurm import task as slurm_task
from torchlaunch.exit_codes import BAD_INPUT, CANCELLED, FAILURE, PREEMPTED
from torchlaunch.jobs import record

HOSTILE = "x\ntouch F #"


def call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = slurm.main(argv)
    return code, out.getvalue(), err.getvalue()


def one_line_refusal(argv: list[str], needle: str) -> str:
    code, out, err = call(argv)
    assert code == BAD_INPUT and out == "", err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    return err


@pytest.fixture
def submit_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "submit"
    work.mkdir()
    (work / "script.py").write_text("print('hi')\n")
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--job-name", "a\nb"], "--job-name"),
        (["--partition", "gpu\ntouch F"], "--partition"),
        (["--sbatch", "mail-type=END\ntouch F"], "--sbatch mail-type"),
        (["--sbatch", "bad key=1"], "not an sbatch option name"),
    ],
)
def test_multi_line_sbatch_values_are_refused(submit_dir: Path, tmp_path: Path, extra: list[str], needle: str) -> None:
    one_line_refusal(["--dry-run", *extra, "--run-dir", str(tmp_path / "r"), "--", "script.py"], needle)


def test_a_bad_job_name_is_refused_before_anything_is_written(
    submit_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurm, "have", lambda tool: True)  # as on a login node
    monkeypatch.setattr(slurm, "check_slurm_conf", lambda: None)
    monkeypatch.setattr(slurm, "cluster_partitions", lambda: None)
    monkeypatch.setattr(slurm, "_submit", lambda *a: pytest.fail("submitted"))
    one_line_refusal(["--job-name", "a\nb", "--run-dir", str(tmp_path / "r"), "--", "script.py"], "--job-name")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", ["a%x", "a%%j", "a\\b"])
def test_pattern_characters_in_the_run_dir_are_refused(submit_dir: Path, tmp_path: Path, name: str) -> None:
    one_line_refusal(["--dry-run", "--run-dir", str(tmp_path / name), "--", "script.py"], "--run-dir")


def test_submit_takes_the_run_dir_hands_it_to_the_job_and_records_it(
    submit_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Job:
        job_id = "4242"

    monkeypatch.setattr(slurm, "_submit", lambda spec, options, run_dir: Job())
    spec, options, _ = slurm.parse_args(["--run-dir", str(tmp_path / "run"), "--", "script.py"])
    slurm.submit(spec, options)
    holder = runlock.read_holder(tmp_path / "run" / runlock.LOCK_NAME)
    assert holder is not None and (holder.scheduler, holder.job_id) == ("slurm", "4242")
    [rec], _ = record.read_all(tmp_path / "run")
    assert (rec.scheduler, rec.job_id, rec.launch_id, rec.outcome) == ("slurm", "4242", "4242-0", None)
    assert rec.command[:3] == ("python", "-m", "launch.slurm")
    monkeypatch.setattr(slurm_backend, "have", lambda tool: True)
    monkeypatch.setattr(slurm_backend, "controller_state", lambda job_id: "RUNNING")
    with pytest.raises(slurm.BadInput, match="in use by slurm job 4242"):
        slurm.submit(spec, options)
    monkeypatch.setattr(slurm_backend, "controller_state", lambda job_id: "UNKNOWN")  # over: taken over
    slurm.submit(spec, options)


def test_wait_ends_when_scontrol_says_failed_although_sacct_says_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Job:
        job_id = "7"
        paths = type("Paths", (), {"folder": str(tmp_path)})()

        def exception(self) -> None:
            return None

    asked: list[str] = []
    monkeypatch.setattr(
        slurm_follow, "STATE_SOURCES", (lambda j: asked.append("sacct") or "UNKNOWN", lambda j: "FAILED")
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert slurm_follow.follow(Job(), poll_s=0, out=io.StringIO()) == FAILURE
    assert asked == ["sacct"] and "job 7 ended FAILED" in err.getvalue()


def test_scontrol_state_reads_the_job_state(monkeypatch: pytest.MonkeyPatch) -> None:
    line = "JobId=7 JobName=train UserId=u(1) JobState=FAILED Reason=NonZeroExitCode Dependency=(null)\n"
    monkeypatch.setattr(slurm_cluster, "run", lambda *a, **k: slurm_cluster.Answer(0, line, ""))
    assert slurm_cluster.scontrol_state("7") == "FAILED"


def test_a_failed_job_shows_the_first_failing_rank_its_node_and_its_stderr(tmp_path: Path) -> None:
    folder = tmp_path / "slurm" / "9"
    folder.mkdir(parents=True)
    for task, host, err in (
        (0, "node-a", "slurm task ... waiting\n"),
        (1, "node-b", "Traceback (most recent call last):\nValueError: You set devices=2\nHINT: Set devices=1\n"),
        (2, "node-b", "Traceback (most recent call last):\nRuntimeError: peer closed\n"),
    ):
        (folder / f"9_{task}_log.out").write_text(f"slurm task: rank {task}/3 local 0 master a:1 (x) on {host}\n")
        (folder / f"9_{task}_log.err").write_text(err)
        os.utime(folder / f"9_{task}_log.err", (1000 + task, 1000 + task))
    report = slurm_follow.failure_report(folder, "9", "FAILED")
    lines = report.splitlines()
    assert lines[0] == "job 9 ended FAILED"
    assert lines[1].startswith("first failing: rank 1 on node-b (1 more task(s) failed); last lines of ")
    assert "  HINT: Set devices=1" in lines and "RuntimeError: peer closed" not in report
    assert lines[-1] == f"all logs: {folder}"


class Left(Exception):
    """slurm_task.leave's stand-in: os._exit would end pytest."""


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """How a task ends, in-process: leave raises Left(code); the codes recorded for --wait are listed."""
    recorded: list[tuple[int, str]] = []

    def leave(code: int) -> None:
        raise Left(code)

    monkeypatch.setattr(slurm_task, "leave", leave)
    monkeypatch.setattr(slurm_task, "write_result", lambda code, why: recorded.append((code, why)))
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    return recorded


CLEAN_CANCEL = (
    "slurm task: job 55 was cancelled ({how}), not requeued; "
    "its progress is checkpointed: submit the same command again to resume"
)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_cancelled_launch_ends_every_task_with_one_line_and_exit_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ends: list, rank: int
) -> None:
    """`launch cancel`: every task (rank 0 and the ranks that never requeue) ends with one line and the
    table's 3, recorded for --wait; no WorkerExit, whose re-raise by submitit left a 20-line traceback
    and srun's "task 0: Exited with exit code 1" in the task logs, and no requeue."""
    task = slurm_task.SlurmTask(argv=["x.py"], time_min=60, signal_delay_s=90, run_dir=str(tmp_path))
    assert task.launch_id() == "55-2"
    record.request_cancel(tmp_path, "55-2", "test")
    monkeypatch.setattr(slurm_task, "controller_state", lambda job_id: pytest.fail("asked to requeue"))
    with pytest.raises(Left) as left:
        task._requeue(rank, 10.0)
    assert left.value.args == (CANCELLED,)
    out, err = capsys.readouterr()
    assert out.splitlines() == [CLEAN_CANCEL.format(how="python -m launch cancel")] and err == ""
    assert [code for code, _ in ends] == [CANCELLED]


def test_a_scancel_ends_rank_0_cancelled_and_a_hard_time_limit_preempted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ends: list
) -> None:
    """A plain scancel leaves no mark: squeue says COMPLETING, accounting says CANCELLED, and rank 0 ends
    as a cancel; the hard time limit (also COMPLETING) still ends preempted, not requeued."""
    task = slurm_task.SlurmTask(argv=["x.py"], time_min=60, signal_delay_s=90, run_dir=str(tmp_path))
    monkeypatch.setattr(slurm_task, "controller_state", lambda job_id: "COMPLETING")
    monkeypatch.setattr(slurm_task, "job_state", lambda job_id: "CANCELLED by 1000")
    with pytest.raises(Left) as left:
        task._requeue(0, 10.0)
    assert left.value.args == (CANCELLED,)
    assert capsys.readouterr().out.splitlines() == [CLEAN_CANCEL.format(how="scancel")]
    monkeypatch.setattr(slurm_task, "job_state", lambda job_id: "TIMEOUT")
    with pytest.raises(slurm_task.WorkerExit) as raised:
        task._requeue(0, 10.0)
    assert raised.value.code == PREEMPTED


def test_a_cancel_that_met_a_failed_program_claims_no_checkpoint(
    capsys: pytest.CaptureFixture[str], ends: list
) -> None:
    with pytest.raises(Left):
        slurm_task.end_cancelled("55", slurm_task.LAUNCH_CANCEL, FAILURE)
    said = capsys.readouterr().out
    assert "exit 1" in said and "checkpointed" not in said and len(said.splitlines()) == 1


def test_a_hang_requeues_once_then_ends_the_hung_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "56")
    calls: list[list[str]] = []
    killed: list[object] = []
    monkeypatch.setattr(
        slurm_cluster, "run", lambda argv, *a, **k: calls.append(list(argv)) or slurm_cluster.Answer(0, "", "")
    )
    monkeypatch.setattr(slurm_task.SlurmTask, "_save_for_requeue", lambda self: None)
    monkeypatch.setattr(slurm_task.watchdog, "kill_ranks", lambda beats: killed.append(beats) or [])
    task = slurm_task.SlurmTask(argv=["x.py"], time_min=60, signal_delay_s=90, run_dir=str(tmp_path))
    op = type("Op", (), {"dog": None})()
    verdict = type("Verdict", (), {"reason": "no rank progressed for 9s"})()
    task._on_hang(verdict, tmp_path, ["beat"], op)  # type: ignore[arg-type]
    assert calls == [["scontrol", "requeue", "56"]] and task.hangs == 1 and not killed
    task._on_hang(verdict, tmp_path, ["beat"], op)  # type: ignore[arg-type]
    assert len(calls) == 1 and killed == [["beat"]]


class BrokenPipe(io.StringIO):
    """A task's stdout after srun ended the step's I/O on a cancel (`srun: forcing job termination`)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_cancel_line_reaches_the_task_log_when_srun_closed_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: list
) -> None:
    """Seen on the dev cluster: a cancel as the tasks started met a broken stdout; print raised, submitit
    re-raised it (exit 1). The task still ends 3, its line appended to its own output file, and a link
    planted at that name is not written through."""
    import submitit

    log = tmp_path / "55_1_log.out"
    log.write_text("slurm task: rank 1/2\n")
    monkeypatch.setattr(submitit, "JobEnvironment", lambda: type("Env", (), {"paths": type("P", (), {"stdout": log})}))
    monkeypatch.setattr(sys, "stdout", BrokenPipe())
    with pytest.raises(Left) as left:
        slurm_task.end_cancelled("55", slurm_task.LAUNCH_CANCEL)
    assert left.value.args == (CANCELLED,) and [code for code, _ in ends] == [CANCELLED]
    assert log.read_text().splitlines() == ["slurm task: rank 1/2", CLEAN_CANCEL.format(how="python -m launch cancel")]
    outside = tmp_path / "outside.txt"
    outside.write_text("")
    log.unlink()
    log.symlink_to(outside)
    with pytest.raises(Left):
        slurm_task.end_cancelled("55", slurm_task.LAUNCH_CANCEL)
    assert outside.read_text() == ""
