"""A user's own script or module on every launcher: launch.program's contract, launch.local with real
torchrun (exit codes, signals, restarts, -m from the working directory), the Slurm and Kubernetes
renderings (golden files) and, on the dev cluster, requeue of a preempted user program.

The programs under tests/programs/ use no torchlaunch.api: they only exit, raise, or handle SIGTERM.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, error_lines, launcher_argv, run_cmd, run_launcher, run_module
from tests.test_slurm_cluster import cluster  # noqa: F401 - the dev cluster fixture
from torchlaunch import runner as program_mod
from torchlaunch.backends.local import launch as local
from torchlaunch.backends.local.launch import NodePlacement, torchrun_argv
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED, BadInput
from torchlaunch.launch.spec import JobSpec

GOLDEN = Path(__file__).parent / "golden"
PROGRAMS = Path(__file__).parent / "programs"
EXIT_WITH = "tests/programs/exit_with.py"
CPU = ["--device", "cpu"]


def check_golden(name: str, text: str) -> None:
    """UPDATE_GOLDEN=1 rewrites the file (review the diff before committing)."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"rendering changed; if intended, UPDATE_GOLDEN=1 and review {path}"


def records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


# ---------------------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train.py", "--lr", "0.1"], program_mod.Program(script="train.py", args=("--lr", "0.1"))),
        (["--", "train.py"], program_mod.Program(script="train.py")),
        (["-m", "pkg.train", "-m", "x"], program_mod.Program(module="pkg.train", args=("-m", "x"))),
        (["-mpkg.train", "a"], program_mod.Program(module="pkg.train", args=("a",))),
    ],
)
def test_parse_program(argv: list[str], expected: program_mod.Program) -> None:
    program = program_mod.parse(argv)
    assert program == expected
    assert program.argv() == ([expected.script] if expected.script else ["-m", expected.module]) + list(expected.args)


@pytest.mark.parametrize(
    ("argv", "words"),
    [([], "no program given"), (["-m"], "-m needs a module name"), (["--lr"], "looks like an option")],
)
def test_parse_program_rejects(argv: list[str], words: str) -> None:
    with pytest.raises(BadInput, match=words):
        program_mod.parse(argv)


def test_module_is_found_on_disk_without_importing_it() -> None:
    search = [str(PROGRAMS)]
    assert program_mod.module_origin("userpkg.main", search) == str(PROGRAMS / "userpkg" / "main.py")
    assert program_mod.module_origin("userpkg", search) == str(PROGRAMS / "userpkg" / "__init__.py")
    assert program_mod.module_origin("userpkg.nope", search) is None
    assert program_mod.module_origin("exit_with.sub", search) is None  # a plain module has no submodules
    assert program_mod.module_origin("not-a-name", search) is None
    assert "userpkg" not in sys.modules  # found, never imported (its parents neither)


def test_check_names_the_missing_script_and_module(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"script nope\.py: no such file in .*\(pass an existing SCRIPT\.py"):
        program_mod.check(program_mod.Program(script="nope.py"), cwd=str(tmp_path))
    with pytest.raises(BadInput, match=r"module userpkg\.nope: not found"):
        program_mod.check(program_mod.Program(module="userpkg.nope"), cwd=str(PROGRAMS))
    program_mod.check(program_mod.Program(module="userpkg.main"), cwd=str(PROGRAMS))
    program_mod.check(program_mod.Program(script="exit_with.py"), cwd=str(PROGRAMS))


def test_torchrun_argv_of_a_program_golden() -> None:
    spec = JobSpec(program=("train.py", "--epochs", "3"), nodes=2, gpus_per_node=8, master_port=29555, max_restarts=1)
    argv = torchrun_argv(
        spec, NodePlacement(node_rank=1, master_addr="node0"), python="python", rdzv_run_id="tl-golden"
    )
    check_golden("local_argv_program.txt", "\n".join(argv) + "\n")


@pytest.mark.parametrize(
    ("torchrun", "codes", "ranks", "expected"),
    [
        (-6, [OK, OK], 2, OK),  # both finished; one aborted in C++ teardown afterwards
        (1, [OK], 2, FAILURE),  # a rank never reported
        (1, [OK, OK], None, FAILURE),  # the rank count unknown: torchrun's word stands
        (1, [OK, PREEMPTED], 2, PREEMPTED),
    ],
)
def test_a_teardown_abort_after_every_rank_finished_is_a_finish(
    torchrun: int, codes: list[int], ranks: int | None, expected: int
) -> None:
    assert local.combine_exit_codes(torchrun, codes, ranks) == expected


def test_program_rendezvous_id_is_the_same_on_every_node() -> None:
    a = local.program_id(["train.py", "x"], NodePlacement(0, "node0"), 29500)
    assert a == local.program_id(["train.py", "x"], NodePlacement(1, "node0"), 29500)
    assert a != local.program_id(["train.py", "y"], NodePlacement(0, "node0"), 29500)


@pytest.mark.parametrize(
    ("launcher_args", "tail"),
    [
        (
            ["--gpus", "2"],
            [
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "0",
                "--standalone",
                "-m",
                "torchlaunch.runner",
                EXIT_WITH,
                "0",
                "a b",
            ],
        ),
        (["--gpus", "1"], None),  # one worker without restarts: no agent, the runner directly
        (
            ["--gpus", "1", "--max-restarts", "2"],
            [
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "2",
                "--standalone",
                "-m",
                "torchlaunch.runner",
                EXIT_WITH,
                "0",
                "a b",
            ],
        ),
    ],
)
def test_dry_run_prints_the_exact_command(
    launcher_args: list[str],
    tail: list[str] | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    rc = local.main([*launcher_args, *CPU, "--dry-run", "--", EXIT_WITH, "0", "a b"])
    out = capsys.readouterr().out
    assert rc == OK and len(out.splitlines()) == 1
    argv = shlex.split(out)
    if tail is None:
        assert argv == [sys.executable, "-m", "torchlaunch.runner", EXIT_WITH, "0", "a b"]
    else:
        assert argv[:4] == launcher_argv("torchlaunch.launch.torchrun", "--nnodes") and argv[5:] == tail


def test_dry_run_of_a_module_and_of_the_doctor(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(PROGRAMS)
    assert local.main([*CPU, "--dry-run", "--", "-m", "userpkg.main", "0", "out"]) == OK
    assert shlex.split(capsys.readouterr().out) == [
        sys.executable,
        "-m",
        "torchlaunch.runner",
        "-m",
        "userpkg.main",
        "0",
        "out",
    ]
    assert local.main([*CPU, "--doctor", "--dry-run", "--", "-m", "userpkg.main"]) == OK
    argv = shlex.split(capsys.readouterr().out)
    assert argv[1:3] == ["-m", "torchlaunch.launch.torchrun"] and argv[-4:-1] == [
        "-m",
        "torchlaunch.tools.preflight",
        "--config",
    ]
    assert argv[-1].endswith("doctor.yaml") and not Path(argv[-1]).exists()  # a dry run creates nothing


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--", "nope.py"], "launch error: script nope.py: no such file in "),
        (["--", "-m", "nope_pkg.train"], "launch error: module nope_pkg.train: not found from "),
        (["--config", "configs/smoke.yaml", "--", EXIT_WITH], "--config applies to the built-in worker, not to "),
        (["optim.lr=0.1", "--", EXIT_WITH], "config overrides (optim.lr=0.1) apply to the built-in worker"),
        (["--gpus", "0", "--", EXIT_WITH], "--gpus must be >= 1"),
        (["--", "-m"], "-m needs a module name"),
        ([], "--config is required for the built-in worker"),
    ],
)
def test_bad_program_arguments_are_one_line_and_exit_2(
    args: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    rc = local.main([*CPU, *args])
    captured = capsys.readouterr()
    assert rc == BAD_INPUT and captured.out == ""
    assert len(captured.err.splitlines()) == 1 and words in captured.err, captured.err


# -------------------------------------------------------------------- launch.program without a launcher


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


# ------------------------------------------------------------------------ launch.local, real torchrun


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize(("program_code", "launch_code"), [(0, OK), (2, BAD_INPUT), (75, PREEMPTED), (3, FAILURE)])
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
            "torchlaunch.backends.local.launch",
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


def test_rank_path_drops_the_project_root_but_never_an_installs_site_packages(tmp_path: Path) -> None:
    from torchlaunch import rankpath

    assert rankpath.pythonpath(f"/a{os.pathsep}{REPO}") == f"/a{os.pathsep}{REPO / 'rankpath'}"
    site = tmp_path / "site-packages"  # an installed torchlaunch: no rankpath/ beside it
    (site / "torchlaunch").mkdir(parents=True)
    assert rankpath.pythonpath(str(site), site) == str(site)


def assert_only_torchlaunch_importable(seen: list[dict[str, str | None]]) -> None:
    """A rank's `import tests` (or bench, examples, ...) is the user's, never the project's: the launcher
    puts torchlaunch alone on the path (torchlaunch.rankpath), even when its own PYTHONPATH holds
    the project root (these tests' child_env does)."""
    assert seen
    for found in seen:
        assert found["torchlaunch"] is not None and str(REPO) in found["torchlaunch"], found
        assert {k: v for k, v in found.items() if k != "torchlaunch" and v is not None} == {}, found


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
    assert sorted(runs.read_text().splitlines()) == ["rank 0 restart 0", "rank 1 restart 0"]


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
    proc = subprocess.Popen(
        launcher_argv(
            "torchlaunch.backends.local.launch",
            "--gpus",
            str(gpus),
            *CPU,
            "--",
            "tests/programs/wait_for_term.py",
            str(out),
        ),
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(out.glob("rank*.json"))) < gpus:  # every rank's handler is installed
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == PREEMPTED, err
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


# ---------------------------------------------------------------------------------------------- Slurm


def test_sbatch_script_of_a_program_golden() -> None:
    from torchlaunch.backends.slurm.launch import SlurmOptions, sbatch_script, task_argv

    spec = JobSpec(
        program=("/opt/code/train.py", "--epochs", "3"),
        nodes=2,
        gpus_per_node=1,
        run_dir="/shared/runs/mine",
        time_min=30,
    )
    options = SlurmOptions(
        use_gpus=False,
        python="/opt/venv/bin/python",
        repo_root="/opt/repo",
        cwd="/opt/code",
        job_name="train",
    )
    check_golden("slurm_program.sbatch", sbatch_script(spec, options))
    assert task_argv(spec, options, "/shared/runs/mine") == ["/opt/code/train.py", "--epochs", "3"]
    builtin = JobSpec(config="configs/smoke.yaml", run_dir="/shared/runs/mine")
    assert task_argv(builtin, options, "/shared/runs/mine")[:2] == ["-m", "torchlaunch.worker"]  # the same runner


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


def slurm_launch(run_dir: Path, program: list[str], *args: str, cwd: Path = REPO) -> subprocess.Popen:
    """`python -m launch.slurm ARGS --run-dir RUN_DIR --wait -- PROGRAM` in the background."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    # A child inherits an ignored SIGINT (pytest run in the background: `cmd &` in a script ignores it),
    # never a handler: with one installed here the launcher starts with SIGINT at its default, as from a
    # terminal, and a test's Ctrl-C reaches it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _start_launcher(run_dir, program, args, cwd)
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_launcher(run_dir: Path, program: list[str], args: tuple[str, ...], cwd: Path) -> subprocess.Popen:
    with open(run_dir.parent / f"{run_dir.name}.launcher.log", "w") as out:
        return subprocess.Popen(
            launcher_argv(
                "torchlaunch.backends.slurm.launch",
                *args,
                "--run-dir",
                str(run_dir),
                "--wait",
                "--",
                *program,
            ),
            cwd=cwd,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def launcher_text(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.launcher.log").read_text()


def finish(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"launcher did not return in {timeout_s} s:\n{launcher_text(run_dir)[-3000:]}") from None


def count(state: Path, rank: int) -> int:
    path = state / f"count-rank{rank}"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


@pytest.mark.slurm
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("cluster")
def test_slurm_preempted_program_is_requeued_and_finishes(tmp_path: Path) -> None:
    from tests.test_slurm_cluster import requeue_records, slurm, wait_until

    run_dir, state = tmp_path / "counter", tmp_path / "counter" / "state"
    proc = slurm_launch(
        run_dir,
        ["tests/programs/counter.py", str(state), "150"],
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--time",
        "30",
    )
    wait_until(lambda: count(state, 0) >= 30 and count(state, 1) >= 30, 120, "both ranks to count to 30")
    slurm("sbatch", "-p", "high", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1")
    assert finish(proc, run_dir, 300) == OK, launcher_text(run_dir)[-3000:]
    job_id = launcher_text(run_dir).split("submitted job ", 1)[1].split(":", 1)[0]
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
    from tests.test_slurm_cluster import requeue_records

    run_dir = tmp_path / "bad"
    proc = slurm_launch(
        run_dir,
        ["tests/programs/bad_input.py", str(tmp_path / "runs")],
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--time",
        "10",
    )
    assert finish(proc, run_dir, 150) == BAD_INPUT, launcher_text(run_dir)[-3000:]
    job_id = launcher_text(run_dir).split("submitted job ", 1)[1].split(":", 1)[0]
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
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--time",
        "10",
        cwd=PROGRAMS,
    )
    assert finish(proc, run_dir, 150) == OK, launcher_text(run_dir)[-3000:]
    seen = records(out)
    assert len(seen) == 2 and all(s["cwd"] == str(PROGRAMS) and s["path0"] == str(PROGRAMS) for s in seen)
    assert {s["world_size"] for s in seen} == {"2"} and all(s["name"] == "__main__" for s in seen)


# ----------------------------------------------------------------------------------------- Kubernetes


def render_k8s(argv: list[str]) -> tuple[int, str, str]:
    from tests.test_k8s import render

    return render(argv)


def test_k8s_program_manifest_golden() -> None:
    import yaml

    code, out, err = render_k8s(
        [
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--image",
            "reg.example/mine:1",
            "--name",
            "mine",
            "--workdir",
            "/code",
            "--run-dir",
            "/shared/runs/mine",
            "--",
            "train.py",
            "--epochs",
            "3",
            "--run-dir",
            "/shared/runs/mine",
        ]
    )
    assert code == OK, err
    check_golden("k8s_program.yaml", out)
    objs = {d["kind"]: d for d in yaml.safe_load_all(out)}
    assert "ConfigMap" not in objs  # a user's program has no recipe
    container = objs["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert container["workingDir"] == "/code"
    assert container["args"][0].splitlines()[-1].endswith("--gpus 4 -- train.py --epochs 3 --run-dir /shared/runs/mine")
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/shared", "/dev/shm", "/tmp"}
    rules = objs["Job"]["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [BAD_INPUT]


def test_k8s_pod_command_is_accepted_by_launch_local(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod's exec line, with the pod's variables filled in, is a valid launch of the program."""
    import yaml

    code, out, err = render_k8s(["--nodes", "2", "--gpus-per-node", "2", "--cpu-only", "--", EXIT_WITH, "0", "o d"])
    assert code == OK, err
    job = next(d for d in yaml.safe_load_all(out) if d["kind"] == "Job")
    line = job["spec"]["template"]["spec"]["containers"][0]["args"][0].splitlines()[-1]
    for var, value in (("JOB_COMPLETION_INDEX", "1"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29511")):
        line = line.replace(f'"${var}"', value)
    argv = shlex.split(line)
    assert argv[:4] == ["exec", "python", "-m", "torchlaunch.backends.local.launch"]
    monkeypatch.chdir(REPO)
    assert local.main(["--dry-run", *argv[4:]]) == OK
    printed = shlex.split(capsys.readouterr().out)
    assert printed[printed.index("--rdzv-endpoint") + 1] == "node0:29511" and "--node-rank" in printed
    assert printed[-5:] == ["-m", "torchlaunch.runner", EXIT_WITH, "0", "o d"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--config", "configs/smoke.yaml", "--", "train.py"], "--config applies to the built-in worker"),
        (["seed=1", "--", "train.py"], "config overrides (seed=1) apply to the built-in worker"),
        (["--workdir", "code", "--", "train.py"], "--workdir 'code' must be an absolute path"),
        (["--", "-m"], "-m needs a module name"),
    ],
)
def test_k8s_bad_program_arguments(args: list[str], words: str) -> None:
    code, out, err = render_k8s(args)
    assert code == BAD_INPUT and out == ""
    assert len(err.splitlines()) == 1 and words in err, err


# ----------------------------------------------- examples/custom_loop.py: interrupted = uninterrupted


CUSTOM_LOOP = "examples/custom_loop.py"
CUSTOM_EPOCHS = "8"
"""8 epochs of 32 steps on 2 CPU ranks: long enough to be interrupted twice."""
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""As in a Slurm task here (SLURM_CPUS_PER_TASK unset): the same float sums on both launchers."""


def custom_loop_launch(run_dir: Path) -> list[str]:
    return launcher_argv(
        "torchlaunch.backends.local.launch",
        "--gpus",
        "2",
        *CPU,
        "--",
        CUSTOM_LOOP,
        "--run-dir",
        str(run_dir),
        "--epochs",
        CUSTOM_EPOCHS,
    )


@pytest.fixture(scope="module")
def custom_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted custom_loop run on 2 CPU ranks under launch.local: the weights to match."""
    run_dir = tmp_path_factory.mktemp("custom") / "reference"
    rc, out, err = run_cmd(custom_loop_launch(run_dir), timeout=400, env=ONE_THREAD)
    assert rc == OK, err[-3000:]
    assert f"finished: {32 * int(CUSTOM_EPOCHS)} steps" in out
    return run_dir / "model.pt"


def run_until_step_then_sigterm(run_dir: Path, step: int) -> tuple[int, str]:
    """Start the launch, SIGTERM the launcher once rank 0 printed `step`; (exit code, stdout)."""
    proc = subprocess.Popen(
        custom_loop_launch(run_dir),
        cwd=REPO,
        env=child_env(ONE_THREAD),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded by the test's timeout; the program prints every step
            seen.append(line)
            if line.startswith(f"step {step}/"):
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, "".join(seen) + out + "\n" + err


@pytest.mark.slow
@pytest.mark.extended  # one stop and rerun of the custom loop: test_api.py, in CI's tier
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


@pytest.mark.slurm
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("cluster")
def test_custom_loop_preempted_on_slurm_resumes_bitwise(custom_reference: Path, tmp_path: Path) -> None:
    from tests.helpers import assert_models_equal
    from tests.test_slurm_cluster import requeue_records, slurm, wait_until

    run_dir = tmp_path / "custom"
    proc = slurm_launch(
        run_dir,
        [CUSTOM_LOOP, "--run-dir", str(run_dir), "--epochs", CUSTOM_EPOCHS],
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--time",
        "30",
    )
    job_id = wait_until(
        lambda: launcher_text(run_dir).partition("submitted job ")[2].partition(":")[0], 60, "the job id"
    )
    log = run_dir / "slurm" / job_id / f"{job_id}_0_log.out"
    wait_until(lambda: log.exists() and "step 60/" in log.read_text(), 240, "rank 0 to reach step 60")
    slurm("sbatch", "-p", "high", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1")
    assert finish(proc, run_dir, 400) == OK, launcher_text(run_dir)[-3000:]
    assert requeue_records(job_id) == ["REQUEUED", "COMPLETED"]
    text = log.read_text()
    assert "preemption: checkpoint committed" in text and "resumed at step " in text
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


def test_peer_bad_input_reads_only_this_attempts_other_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchlaunch import status

    monkeypatch.setenv(status.ATTEMPT_ENV, "A1")
    monkeypatch.setenv(status.STATUS_DIR_ENV, str(tmp_path))
    assert status.peer_bad_input(0) is None
    (tmp_path / "A0-rank1.json").write_text('{"code": 2, "reason": "older launch", "rank": 1}')
    (tmp_path / "A1-rank2.json").write_text('{"code": 2, "reason": "forged", "rank": "x"}')
    (tmp_path / "A1-rank3.json").write_text("[1, 2]")
    (tmp_path / "A1-rank4.json").write_bytes(b"\xff\xfe")
    (tmp_path / "A1-rank5.json").write_text('{"code": 1, "reason": "crash", "rank": 5}')
    assert status.peer_bad_input(0) is None
    (tmp_path / "A1-rank0.json").write_text('{"code": 2, "reason": "mine", "rank": 0}')
    assert status.peer_bad_input(0) is None  # its own record is not a peer's
    (tmp_path / "A1-rank1.json").write_text('{"code": 2, "reason": "data error: x", "rank": 1}')
    assert status.peer_bad_input(0) == (1, "data error: x")


@pytest.mark.slurm
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("cluster")
def test_slurm_wait_shows_stderr_and_ctrl_c_leaves_the_job_running_in_one_line(tmp_path: Path) -> None:
    """--wait streamed rank 0's stdout only (a `logging` program showed nothing), and Ctrl-C was a
    KeyboardInterrupt traceback with no word on the job, which kept running."""
    from tests.test_slurm_cluster import slurm, wait_until

    script = tmp_path / "logs.py"
    script.write_text("import logging, time\nlogging.warning('to stderr via logging')\ntime.sleep(600)\n")
    run_dir = tmp_path / "run"
    proc = slurm_launch(run_dir, [str(script)], "--nodes", "1", "--tasks-per-node", "1", "--time", "10")
    try:
        wait_until(lambda: "to stderr via logging" in launcher_text(run_dir), 120, "the program's stderr line")
        proc.send_signal(signal.SIGINT)
        code = finish(proc, run_dir, 60)
        text = launcher_text(run_dir)
        job_id = text.split("submitted job ", 1)[1].split(":", 1)[0]
        assert code == 130 and "Traceback" not in text, text[-2000:]
        lines = [line for line in text.splitlines() if "stopped following" in line]
        assert lines == [
            f"launch: SIGINT: stopped following job {job_id}; the job keeps running (cancel it with: scancel {job_id})"
        ]
        assert slurm("squeue", "-h", "-j", job_id, "-o", "%T").strip() in ("RUNNING", "PENDING")
    finally:
        if proc.poll() is None:
            proc.kill()
        text = launcher_text(run_dir)
        if "submitted job " in text:
            slurm("scancel", text.split("submitted job ", 1)[1].split(":", 1)[0])


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
