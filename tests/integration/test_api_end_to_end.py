"""test_api_end_to_end: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_api.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launcher_argv, run_cmd
from tests.helpers import assert_models_equal
from tests.unit.test_api import LAGGED, SEEDED, SLOW_START, committed_steps, run_example, run_snippet, sigterm_at_step
from torchlaunch import api
from torchlaunch.core import checkpoint as ckpt


@pytest.mark.parametrize("form", ["plain", "with"])
def test_save_then_exit_preempted_commits_before_the_process_ends(tmp_path: Path, form: str) -> None:
    """An async save still being written (held open by the fault-injection stall) when the script
    calls sys.exit(api.PREEMPTED): the commit completes first (atexit hook / teardown)."""
    body = "ckpt = api.Checkpointer(RUN); ckpt.save(5, {'w': torch.ones(1000)}); sys.exit(api.PREEMPTED)"
    if form == "with":
        body = f"with api.setup():\n    {body}"
    else:
        body = f"api.setup()\n{body}"
    code = f"import sys, torch\nfrom torchlaunch import api\nRUN = {str(tmp_path)!r}\n{body}\n"
    rc, out, err = run_snippet(code, env={"TORCHLAUNCH_FAULT_SAVE_STALL_S": "1"})
    assert rc == api.PREEMPTED, err[-2000:]
    assert ckpt.verify(tmp_path / "checkpoints" / "step-000000005") is None


def test_unwritable_run_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = f"""
        from torchlaunch import api
        with api.setup():
            api.Checkpointer({str(blocker / "run")!r})
            raise SystemExit(0)
    """
    rc, out, err = run_snippet(code)
    assert rc == api.BAD_INPUT, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Checkpointer run_dir" in lines[0] and str(blocker / "run") in lines[0] and "writable" in lines[0]


@pytest.mark.slow
def test_bad_input_under_launch_local_is_reported_once(tmp_path: Path) -> None:
    """Under launch.local the BadInput reaches its program runner, so the launcher prints the reason
    once for both ranks instead of each rank printing its own copy."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    script = tmp_path / "bad_run_dir.py"
    script.write_text(
        f"from torchlaunch import api\nwith api.setup():\n    api.Checkpointer({str(blocker / 'run')!r})\n"
    )
    rc, out, err = run_cmd(launcher_argv("torchlaunch.agent", "--gpus", "2", "--", str(script)), timeout=180)
    assert rc == api.BAD_INPUT, err[-2000:]
    assert err.count("api error: Checkpointer run_dir: cannot write") == 1, err[-2000:]
    assert "Traceback" not in err


def test_broken_env_contract_exits_2_with_one_line() -> None:
    rc, out, err = run_snippet("from torchlaunch import api\napi.setup()\n", env={"RANK": "0", "WORLD_SIZE": "2"})
    assert rc == api.BAD_INPUT
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "MASTER_ADDR" in lines[0], err


@pytest.mark.slow
def test_custom_loop_preempted_and_rerun_matches_uninterrupted(tmp_path: Path) -> None:
    epochs = 8  # 256 steps: the signal lands long before the end
    rc, out, err = run_example(tmp_path / "reference", epochs)
    assert rc == 0, err[-2000:]
    step = SEEDED.randrange(3, 60)
    run_dir = tmp_path / "interrupted"
    rc, out = sigterm_at_step(run_dir, epochs, step)
    assert rc == api.PREEMPTED, out[-3000:]
    stopped = max(committed_steps(run_dir))
    assert stopped >= step and not (run_dir / "model.pt").exists()
    rc, out, err = run_example(run_dir, epochs)
    assert rc == 0, err[-2000:]
    assert f"resumed at step {stopped}\n" in out and f"\nstep {stopped + 1}/" in out
    assert f"\nstep {stopped}/" not in out  # no step is trained twice
    assert_models_equal(tmp_path / "reference" / "model.pt", run_dir / "model.pt")
    rc, out, err = run_example(run_dir, epochs)  # a finished run: nothing to do
    assert rc == 0 and "the run is finished" in out and "step " not in out


@pytest.mark.slow
def test_custom_loop_two_ranks_under_torchrun_resumes_exactly(tmp_path: Path) -> None:
    epochs = 8
    rc, out, err = run_example(tmp_path / "reference", epochs, torchrun=True)
    assert rc == 0, err[-2000:]
    step = SEEDED.randrange(3, 60)
    run_dir = tmp_path / "interrupted"
    rc, out = sigterm_at_step(run_dir, epochs, step, torchrun=True)
    assert rc != 0, out[-3000:]  # torchrun's own code on SIGTERM is not 75 (launch.local maps it)
    assert "received SIGTERM" in out and not (run_dir / "model.pt").exists()
    stopped = max(committed_steps(run_dir))
    assert stopped >= step
    rc, out, err = run_example(run_dir, epochs, torchrun=True)
    assert rc == 0, err[-2000:]
    assert f"resumed at step {stopped}\n" in out and f"\nstep {stopped + 1}/" in out
    assert_models_equal(tmp_path / "reference" / "model.pt", run_dir / "model.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_preemption_requested_answers_two_calls_later_on_every_rank(tmp_path: Path) -> None:
    """A loop asking every step must not sync the device every step: the flag is all-reduced without
    waiting and read 2 calls later (the Trainer's lag), the same call on every rank."""
    script = tmp_path / "lagged.py"
    script.write_text(LAGGED)
    argv = launcher_argv("torchlaunch.agent", "--gpus", "2", "--device", "cpu", "--")
    rc, _, err = run_cmd([*argv, str(script), str(tmp_path)], timeout=180)
    assert rc == api.PREEMPTED, err[-2000:]
    for rank in (0, 1):
        answers = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert answers.index(True) == 6 and all(answers[6:]), (rank, answers)  # posted at call 5, read at 7


def test_a_late_rank_joins_and_the_timeout_bounds_collectives_after_the_start(tmp_path: Path) -> None:
    """timeout_s bounds collectives, not the start: a rank 4 s late joins a group whose timeout is 2 s
    (before, rank 0 gave up at the store after 2 s and the job ended before its first step), and once
    the group is formed a collective whose peer stops answering fails after those 2 s (gloo says how long
    it waited)."""
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    argv = launcher_argv("torchlaunch.agent", "--gpus", "2", "--device", "cpu", "--hang-timeout", "0")
    rc, out, err = run_cmd([*argv, "--", str(script)], timeout=180)
    text = out + err
    assert "rank 0 joined: 2" in text and "rank 1 joined: 2" in text, text[-3000:]
    assert rc == 1 and "2000ms" in text, text[-3000:]
