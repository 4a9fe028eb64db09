"""test_user_programs_runner: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_user_programs.py.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, error_lines, launcher_argv, run_cmd, run_launcher, run_module
from tests.stops import Launch
from tests.unit.test_user_programs import (
    CPU,
    CUSTOM_EPOCHS,
    EXIT_WITH,
    ONE_THREAD,
    PROGRAMS,
    assert_only_torchlaunch_importable,
    custom_loop_launch,
    custom_reference,  # noqa: F401 (fixtures, used by name)
    records,
    run_until_step_then_sigterm,
)
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED


@pytest.mark.parametrize(
    ("source", "code", "stderr_words"),
    [
        ("import sys; sys.exit(75)", PREEMPTED, None),
        ("print('hi')", OK, None),
        ("import sys; sys.exit('a message')", FAILURE, "a message"),
        (
            "from torchlaunch.exit_codes import BadInput\nraise BadInput('data error: x: bad (fix x)\\nmore')",
            BAD_INPUT,
            "data error: x: bad (fix x)",
        ),
        ("raise ValueError('boom')", FAILURE, "ValueError: boom"),
    ],
)
def test_runner_maps_how_the_program_ends(source: str, code: int, stderr_words: str | None, tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(source + "\n")
    rc, out, err = run_module("torchlaunch.runner", [str(script)], timeout=60)
    assert rc == code, err
    if stderr_words:
        assert stderr_words in err
    if code == BAD_INPUT:
        assert error_lines(err) == ["data error: x: bad (fix x)"]  # one line, no traceback
    if code == FAILURE and "ValueError" in source:
        assert "Traceback (most recent call last)" in err


def test_runner_sets_argv_and_path_as_python_does(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc, _, err = run_module("torchlaunch.runner", [str(PROGRAMS / "exit_with.py"), "0", str(out)], timeout=60)
    assert rc == OK, err
    (seen,) = records(out)
    assert seen["argv"] == [str(PROGRAMS / "exit_with.py"), "0", str(out)]
    assert seen["path0"] == str(PROGRAMS) and seen["name"] == "__main__"
    rc, _, err = run_cmd(
        [sys.executable, "-m", "torchlaunch.runner", "-m", "userpkg.main", "3", str(tmp_path / "m")],
        timeout=60,
        cwd=PROGRAMS,
    )
    assert rc == 3, err
    (seen,) = records(tmp_path / "m")
    assert seen["argv"] == [str(PROGRAMS / "userpkg" / "main.py"), "3", str(tmp_path / "m")]
    assert seen["path0"] == str(PROGRAMS) and seen["name"] == "__main__"


def test_runner_reports_for_the_launcher_and_stops_after_a_restart_on_bad_input(tmp_path: Path) -> None:
    status_dir, runs = tmp_path / "status", tmp_path / "runs"
    env = {"TORCHLAUNCH_ATTEMPT_ID": "att1", "TORCHLAUNCH_STATUS_DIR": str(status_dir), "RANK": "1"}
    rc, _, err = run_module("torchlaunch.runner", [str(PROGRAMS / "bad_input.py"), str(runs)], timeout=60, env=env)
    assert rc == BAD_INPUT and error_lines(err) == []  # launch.local prints the reason once for all ranks
    record = json.loads((status_dir / "att1-rank1.json").read_text())
    assert record == {
        "code": 2,
        "reason": "data error: --data /nonexistent.csv: no such file (pass an existing CSV)",
        "rank": 1,
        "finished": False,
        "committed": None,
    }
    rc, _, _ = run_module(
        "torchlaunch.runner",
        [str(PROGRAMS / "bad_input.py"), str(runs)],
        timeout=60,
        env={**env, "TORCHELASTIC_RESTART_COUNT": "1"},
    )
    assert rc == BAD_INPUT
    assert runs.read_text().count("\n") == 1  # the restarted rank did not run the program again


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("program_code", "launch_code", "gpus"),
    [
        *[(code, launched, 1) for code, launched in ((0, OK), (2, BAD_INPUT), (75, PREEMPTED), (3, FAILURE))],
        (0, OK, 2),
        (75, PREEMPTED, 2),
        # two ranks' bad input and failure, in CI's tier: test_bad_input_is_one_line_and_not_rerun_by_restarts
        # (the same line, exit 2) and test_restart_after_a_crash (its second launch: exit 1)
        pytest.param(2, BAD_INPUT, 2, marks=pytest.mark.extended),
        pytest.param(3, FAILURE, 2, marks=pytest.mark.extended),
    ],
)
def test_exit_codes_through_the_launcher(gpus: int, program_code: int, launch_code: int, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc, _, err = run_launcher(["--gpus", str(gpus), *CPU, "--", EXIT_WITH, str(program_code), str(out)], timeout=120)
    assert rc == launch_code, err
    seen = records(out)
    # torchrun stops the other ranks once one fails, perhaps before they recorded anything
    ranks = {s["rank"] for s in seen}
    assert ranks == {str(r) for r in range(gpus)} if program_code == 0 else ranks and ranks <= {"0", "1"}
    assert all(s["argv"] == [EXIT_WITH, str(program_code), str(out)] for s in seen)
    assert all(s["path0"] == str(PROGRAMS) for s in seen)
    # the env contract from torchrun; one worker without the agent gets the same from the launcher
    assert {s["world_size"] for s in seen} == {str(gpus)} and len({s["master_port"] for s in seen}) == 1
    assert all(s["master_port"] for s in seen)
    if launch_code == BAD_INPUT:
        assert f"launch: workers stopped on bad input (exit 2, not retried): {EXIT_WITH} exited 2" in err
    if launch_code == FAILURE:
        assert f"launch: {EXIT_WITH} failed" in err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_module_from_the_working_directory_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc, _, err = run_cmd(
        launcher_argv(
            "torchlaunch.agent",
            "--gpus",
            "2",
            *CPU,
            "--",
            "-m",
            "userpkg.main",
            "0",
            str(out),
        ),
        timeout=120,
        cwd=PROGRAMS,
    )
    assert rc == OK, err
    seen = records(out)
    assert len(seen) == 2 and all(s["path0"] == str(PROGRAMS) and s["cwd"] == str(PROGRAMS) for s in seen)
    assert all(s["argv"] == [str(PROGRAMS / "userpkg" / "main.py"), "0", str(out)] for s in seen)
    assert_only_torchlaunch_importable([s["importable"] for s in seen])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bad_input_is_one_line_and_not_rerun_by_restarts(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    rc, out, err = run_launcher(
        ["--gpus", "2", "--max-restarts", "2", *CPU, "--", "tests/programs/bad_input.py", str(runs)], timeout=150
    )
    assert rc == BAD_INPUT, err
    reason = [ln for ln in error_lines(err) if "nonexistent.csv" in ln]
    assert reason == [
        "launch: workers stopped on bad input (exit 2, not retried): data error: --data "
        "/nonexistent.csv: no such file (pass an existing CSV)"
    ], err
    # never started again; rank 1 may be stopped by the agent before it writes its line (rank 0's bad
    # input ends the attempt at once), so it is allowed to be missing, never to appear with a restart
    ran = sorted(runs.read_text().splitlines())
    assert ran in (["rank 0 restart 0"], ["rank 1 restart 0"], ["rank 0 restart 0", "rank 1 restart 0"]), ran


@pytest.mark.timeout(200)
def test_one_ranks_bad_input_is_one_line_without_its_peers_tracebacks() -> None:
    rc, out, err = run_launcher(["--gpus", "2", *CPU, "--", "tests/programs/bad_input_one_rank.py"], timeout=150)
    assert rc == BAD_INPUT, err
    assert "Traceback" not in err and "closed by peer" not in err, err  # rank 0's failure is the consequence
    assert [ln for ln in error_lines(err) if "nonexistent.csv" in ln] == [
        "launch: workers stopped on bad input (exit 2, not retried): data error: --data "
        "/nonexistent.csv: no such file (pass an existing CSV)"
    ], err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_restart_after_a_crash(tmp_path: Path) -> None:
    rc, out, err = run_launcher(
        ["--gpus", "2", "--max-restarts", "1", *CPU, "--", "tests/programs/crash_once.py", str(tmp_path)], timeout=150
    )
    assert rc == OK, err
    assert "rank 0 finished after restart 1" in out and "rank 1 finished after restart 1" in out
    rc, out, err = run_launcher(
        ["--gpus", "2", *CPU, "--", "tests/programs/crash_once.py", str(tmp_path / "b")], timeout=150
    )
    assert rc == FAILURE and "RuntimeError: first attempt crashes on purpose" in err


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("gpus", [1, 2])
def test_launcher_sigterm_reaches_the_scripts_handler(gpus: int, tmp_path: Path) -> None:
    out = tmp_path / "ready"
    argv = launcher_argv(
        "torchlaunch.agent", "--gpus", str(gpus), *CPU, "--", "tests/programs/wait_for_term.py", str(out)
    )
    with Launch(argv, timeout_s=180) as launch:
        launch.wait_until(lambda: len(list(out.glob("rank*.json"))) >= gpus, "every rank's handler installed")
        launch.deliver("pid", signal.SIGTERM)
        code, _, err = launch.finish()
    assert code == PREEMPTED, err
    assert "launch: preempted" in err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_doctor_for_a_user_program(tmp_path: Path) -> None:
    rc, out, err = run_launcher(
        [
            "--gpus",
            "2",
            *CPU,
            "--doctor",
            "--run-dir",
            str(tmp_path / "shared"),
            "--",
            EXIT_WITH,
            "3",
            str(tmp_path / "never"),
        ],
        timeout=150,
    )
    assert rc == OK, err
    assert "preflight: OK" in out + err and "shared storage" in out + err
    assert not (tmp_path / "never").exists()  # the pre-flight ran instead of the program


def test_slurm_dry_run_makes_the_program_absolute(tmp_path: Path) -> None:
    rc, out, err = run_module(
        "torchlaunch.backends.slurm.launch",
        ["--dry-run", "--nodes", "2", "--tasks-per-node", "1", "--run-dir", str(tmp_path), "--", EXIT_WITH, "0", "x y"],
        timeout=60,
    )
    assert rc == OK, err
    assert f"# program in every task (torchlaunch.runner): {REPO / EXIT_WITH} 0 'x y'\ncd {REPO}\n" in out
    assert f"#SBATCH --output={tmp_path}/slurm/%j/%j_0_log.out" in out and "#SBATCH --job-name=exit_with" in out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--", EXIT_WITH], "no run dir: pass --run-dir"),
        (["--run-dir", "x", "--", "nope.py"], "script " + str(REPO / "nope.py") + ": no such file"),
        (["--run-dir", "x", "--config", "configs/smoke.yaml", "--", EXIT_WITH], "--config applies to the built-in"),
        (["--run-dir", "x", "a=1", "--", EXIT_WITH], "config overrides (a=1) apply to the built-in worker"),
        ([], "--config is required for the built-in worker"),
    ],
)
def test_slurm_bad_program_arguments(args: list[str], words: str) -> None:
    rc, out, err = run_module(
        "torchlaunch.backends.slurm.launch", ["--dry-run", "--tasks-per-node", "1", *args], timeout=60
    )
    assert rc == BAD_INPUT and out == ""
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.slow
@pytest.mark.extended  # one stop and rerun of the custom loop: test_api_end_to_end.py, in CI's tier
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [14])
def test_custom_loop_sigterm_twice_then_bitwise_equal(custom_reference: Path, seed: int, tmp_path: Path) -> None:
    import random

    from tests.helpers import assert_models_equal

    total = 32 * int(CUSTOM_EPOCHS)
    rng = random.Random(seed)
    first = rng.randrange(5, total // 2)
    second = rng.randrange(first + 20, total - 40)
    run_dir = tmp_path / "run"
    code, text = run_until_step_then_sigterm(run_dir, first)
    assert code == PREEMPTED, text[-3000:]
    assert "launch: preempted with a committed checkpoint (exit 75)" in text
    code, text = run_until_step_then_sigterm(run_dir, second)
    assert code == PREEMPTED, text[-3000:]
    resumed = int(text.split("resumed at step ", 1)[1].split()[0])
    assert first <= resumed < second
    rc, out, err = run_cmd(custom_loop_launch(run_dir), timeout=400, env=ONE_THREAD)
    assert rc == OK, err[-3000:]
    assert "resumed at step " in out and f"finished: {total} steps" in out
    assert_models_equal(run_dir / "model.pt", custom_reference)


@pytest.mark.slow
@pytest.mark.extended  # a benchmark's smoke
@pytest.mark.timeout(300)
def test_bench_userscript_quick() -> None:
    """The bench's machinery: both sides train, each timed from its live step lines."""
    from bench import userscript

    result = userscript.run(quick=True)
    assert result.key == "userscript" and result.project > 0 and result.baseline > 0
    assert len(result.rounds) == 1 and result.ratio == pytest.approx(result.project / result.baseline)
