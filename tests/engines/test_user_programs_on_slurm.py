"""test_user_programs_on_slurm: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/unit/test_user_programs.py.
"""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cmd
from tests.engines.test_slurm_cluster import cluster  # noqa: F401 - the dev cluster fixture
from tests.unit.test_user_programs import (
    CUSTOM_LOOP,
    ONE_THREAD,
    PROGRAMS,
    assert_only_torchlaunch_importable,
    count,
    custom_loop_launch,
    finish,
    launcher_text,
    one_task_per_node,
    records,
    slurm_launch,
    submitted_job,
)
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK


@pytest.mark.slurm
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("cluster")
def test_slurm_preempted_program_is_requeued_and_finishes(tmp_path: Path) -> None:
    from tests.engines.test_slurm_cluster import requeue_records, slurm, wait_until

    run_dir, state = tmp_path / "counter", tmp_path / "counter" / "state"
    proc = slurm_launch(
        run_dir,
        ["tests/programs/counter.py", str(state), "150"],
        *one_task_per_node(2, 30),
    )
    wait_until(lambda: count(state, 0) >= 30 and count(state, 1) >= 30, 120, "both ranks to count to 30")
    slurm("sbatch", "-p", "high", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1")
    assert finish(proc, run_dir, 300) == OK, launcher_text(run_dir)[-3000:]
    job_id = submitted_job(run_dir)
    assert requeue_records(job_id) == ["REQUEUED", "COMPLETED"]  # requeued exactly once
    for rank in (0, 1):
        starts = (state / f"starts-rank{rank}").read_text().splitlines()
        assert len(starts) == 2 and starts[0].startswith("0 of 2 cwd ") and not starts[1].startswith("0 ")
        assert all(line.endswith(f"cwd {REPO}") for line in starts)  # ran from the submission directory
        assert count(state, rank) == 150
    assert_only_torchlaunch_importable([json.loads((state / f"importable-rank{r}.json").read_text()) for r in (0, 1)])
    logs = "".join(p.read_text() for p in (run_dir / "slurm" / job_id).glob("*_log.out"))
    assert "at " in logs and "saved, exit 75" in logs and "preemption: checkpoint committed" in logs


@pytest.mark.slurm
@pytest.mark.timeout(200)
@pytest.mark.usefixtures("cluster")
def test_slurm_bad_input_program_is_not_requeued(tmp_path: Path) -> None:
    from tests.engines.test_slurm_cluster import requeue_records

    run_dir = tmp_path / "bad"
    proc = slurm_launch(
        run_dir,
        ["tests/programs/bad_input.py", str(tmp_path / "runs")],
        *one_task_per_node(2, 10),
    )
    assert finish(proc, run_dir, 150) == BAD_INPUT, launcher_text(run_dir)[-3000:]
    job_id = submitted_job(run_dir)
    assert requeue_records(job_id) == ["FAILED"]
    assert len((tmp_path / "runs").read_text().splitlines()) == 2  # one start per task, no second allocation


@pytest.mark.slurm
@pytest.mark.timeout(200)
@pytest.mark.usefixtures("cluster")
def test_slurm_module_from_the_submission_directory(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "module", tmp_path / "out"
    proc = slurm_launch(
        run_dir,
        ["-m", "userpkg.main", "0", str(out)],
        *one_task_per_node(2, 10),
        cwd=PROGRAMS,
    )
    assert finish(proc, run_dir, 150) == OK, launcher_text(run_dir)[-3000:]
    seen = records(out)
    assert len(seen) == 2 and all(s["cwd"] == str(PROGRAMS) and s["path0"] == str(PROGRAMS) for s in seen)
    assert {s["world_size"] for s in seen} == {"2"} and all(s["name"] == "__main__" for s in seen)


SLURM_CUSTOM_EPOCHS = "32"
"""1024 steps (~7 s here): the preemptor's SIGTERM lands 1-5 s (~150 steps here) after its sbatch;
with 8 epochs (256 steps) CI's box finished the job before it arrived, and nothing was preempted."""


@pytest.fixture(scope="module")
def slurm_custom_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted custom_loop run of SLURM_CUSTOM_EPOCHS on 2 CPU ranks: the weights to match."""
    run_dir = tmp_path_factory.mktemp("custom") / "reference"
    rc, out, err = run_cmd(custom_loop_launch(run_dir, SLURM_CUSTOM_EPOCHS), timeout=400, env=ONE_THREAD)
    assert rc == OK, err[-3000:]
    assert f"finished: {32 * int(SLURM_CUSTOM_EPOCHS)} steps" in out
    return run_dir / "model.pt"


@pytest.mark.slurm
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("cluster")
@pytest.mark.extended  # in CI: the custom loop preempted on launch.local (test_api_end_to_end.py), a user program on Slurm
def test_custom_loop_preempted_on_slurm_resumes_bitwise(slurm_custom_reference: Path, tmp_path: Path) -> None:
    from tests.engines.test_slurm_cluster import requeue_records, slurm, wait_until
    from tests.helpers import assert_models_equal

    run_dir = tmp_path / "custom"
    proc = slurm_launch(
        run_dir,
        [CUSTOM_LOOP, "--run-dir", str(run_dir), "--epochs", SLURM_CUSTOM_EPOCHS],
        *one_task_per_node(2, 30),
    )
    job_id = wait_until(
        lambda: launcher_text(run_dir).partition("submitted job ")[2].partition(":")[0], 60, "the job id"
    )
    log = run_dir / "slurm" / job_id / f"{job_id}_0_log.out"
    # Preempt at the first step, so the run's whole length is the margin for the preemptor's latency.
    wait_until(lambda: log.exists() and "step 1/" in log.read_text(), 240, "rank 0 to finish its first step")
    slurm("sbatch", "-p", "high", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1")
    assert finish(proc, run_dir, 400) == OK, launcher_text(run_dir)[-3000:]
    assert requeue_records(job_id) == ["REQUEUED", "COMPLETED"]
    text = log.read_text()
    assert "preemption: checkpoint committed" in text and "resumed at step " in text
    assert_models_equal(run_dir / "model.pt", slurm_custom_reference)


@pytest.mark.slurm
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("cluster")
def test_slurm_wait_shows_stderr_and_ctrl_c_leaves_the_job_running_in_one_line(tmp_path: Path) -> None:
    """--wait streamed rank 0's stdout only (a `logging` program showed nothing), and Ctrl-C was a
    KeyboardInterrupt traceback with no word on the job, which kept running."""
    from tests.engines.test_slurm_cluster import slurm, wait_until

    script = tmp_path / "logs.py"
    script.write_text("import logging, time\nlogging.warning('to stderr via logging')\ntime.sleep(600)\n")
    run_dir = tmp_path / "run"
    proc = slurm_launch(run_dir, [str(script)], *one_task_per_node(1, 10))
    try:
        wait_until(lambda: "to stderr via logging" in launcher_text(run_dir), 120, "the program's stderr line")
        proc.send_signal(signal.SIGINT)
        code = finish(proc, run_dir, 60)
        text = launcher_text(run_dir)
        job_id = submitted_job(run_dir)
        assert code == 130 and "Traceback" not in text, text[-2000:]
        lines = [line for line in text.splitlines() if "stopped following" in line]
        assert lines == [
            f"launch: SIGINT: stopped following job {job_id}; the job keeps running (cancel it with: scancel {job_id})"
        ]
        assert slurm("squeue", "-h", "-j", job_id, "-o", "%T").strip() in ("RUNNING", "PENDING")
    finally:
        if proc.poll() is None:
            proc.kill()
        if "submitted job " in launcher_text(run_dir):
            slurm("scancel", submitted_job(run_dir))


@pytest.mark.slurm
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("cluster")
def test_slurm_wait_on_a_job_no_source_knows_ends_in_one_line(tmp_path: Path) -> None:
    """A job purged by a controller restart is unknown to sacct and scontrol: --wait polled forever."""
    from torchlaunch.backends.slurm import launch as slurm_mod

    class Lost:
        job_id = "987654"
        paths = type("Paths", (), {"folder": str(tmp_path)})()

    err = io.StringIO()
    assert slurm_mod.follow(Lost(), poll_s=0.2, out=io.StringIO(), err=err, lost_after_s=1) == FAILURE
    assert err.getvalue().count("\n") == 1 and "job 987654 is unknown to sacct and scontrol" in err.getvalue()
