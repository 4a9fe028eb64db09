"""A user's own script or module on every launcher: launch.program's contract, launch.local with real
torchrun (exit codes, signals, restarts, -m from the working directory), the Slurm and Kubernetes
renderings (golden files) and, on the dev cluster, requeue of a preempted user program.

The programs under tests/programs/ use no torchlaunch.api: they only exit, raise, or handle SIGTERM.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, launcher_argv, run_cmd
from tests.stops import Launch
from torchlaunch import runner as program_mod
from torchlaunch.agent import commands, node, outcome
from torchlaunch.agent.commands import NodePlacement, torchrun_argv
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED, BadInput
from torchlaunch.launch.spec import JobSpec

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
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
    assert outcome.combine_exit_codes(torchrun, codes, ranks) == expected


def test_program_rendezvous_id_is_the_same_on_every_node() -> None:
    a = commands.program_id(["train.py", "x"], NodePlacement(0, "node0"), 29500)
    assert a == commands.program_id(["train.py", "x"], NodePlacement(1, "node0"), 29500)
    assert a != commands.program_id(["train.py", "y"], NodePlacement(0, "node0"), 29500)


def torchrun_tail(nproc: str, restarts: str, *program: str) -> list[str]:
    """The end of the one-node torchrun command the launcher prints: its flags, the runner, the program."""
    return ["--nproc-per-node", nproc, "--max-restarts", restarts, "--standalone", "-m", "torchlaunch.runner", *program]


@pytest.mark.parametrize(
    ("launcher_args", "tail"),
    [
        (["--gpus", "2"], torchrun_tail("2", "0", EXIT_WITH, "0", "a b")),
        (["--gpus", "1"], None),  # one worker without restarts: no agent, the runner directly
        (["--gpus", "1", "--max-restarts", "2"], torchrun_tail("1", "2", EXIT_WITH, "0", "a b")),
    ],
)
def test_dry_run_prints_the_exact_command(
    launcher_args: list[str],
    tail: list[str] | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    rc = node.main([*launcher_args, *CPU, "--dry-run", "--", EXIT_WITH, "0", "a b"])
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
    assert node.main([*CPU, "--dry-run", "--", "-m", "userpkg.main", "0", "out"]) == OK
    assert shlex.split(capsys.readouterr().out) == [
        sys.executable,
        "-m",
        "torchlaunch.runner",
        "-m",
        "userpkg.main",
        "0",
        "out",
    ]
    assert node.main([*CPU, "--doctor", "--dry-run", "--", "-m", "userpkg.main"]) == OK
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
    rc = node.main([*CPU, *args])
    captured = capsys.readouterr()
    assert rc == BAD_INPUT and captured.out == ""
    assert len(captured.err.splitlines()) == 1 and words in captured.err, captured.err


# -------------------------------------------------------------------- launch.program without a launcher


# ------------------------------------------------------------------------ launch.local, real torchrun


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


# ---------------------------------------------------------------------------------------------- Slurm


def test_sbatch_script_of_a_program_golden() -> None:
    from torchlaunch.backends.slurm.render import SlurmOptions, sbatch_script, task_argv

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


def one_task_per_node(nodes: int, minutes: int) -> tuple[str, ...]:
    """launch.slurm's shape for a program on `nodes` nodes, one task each, within `minutes`."""
    return ("--nodes", str(nodes), "--tasks-per-node", "1", "--time", str(minutes))


def submitted_job(run_dir: Path) -> str:
    """The job id launch.slurm printed when it submitted (its `submitted job ID:` line)."""
    return launcher_text(run_dir).split("submitted job ", 1)[1].split(":", 1)[0]


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


# ----------------------------------------------------------------------------------------- Kubernetes


def render_k8s(argv: list[str]) -> tuple[int, str, str]:
    from tests.unit.test_k8s import render

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
    assert argv[:4] == ["exec", "python", "-m", "torchlaunch.agent"]
    monkeypatch.chdir(REPO)
    assert node.main(["--dry-run", *argv[4:]]) == OK
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


def custom_loop_launch(run_dir: Path, epochs: str = CUSTOM_EPOCHS) -> list[str]:
    return launcher_argv(
        "torchlaunch.agent",
        "--gpus",
        "2",
        *CPU,
        "--",
        CUSTOM_LOOP,
        "--run-dir",
        str(run_dir),
        "--epochs",
        epochs,
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
    with Launch(custom_loop_launch(run_dir), env=ONE_THREAD, timeout_s=400) as launch:
        seen = launch.read_until(f"step {step}/")  # the program prints every step
        launch.deliver("pid", signal.SIGTERM)
        code, out, err = launch.finish()
    return code, "".join(seen) + out + "\n" + err


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
