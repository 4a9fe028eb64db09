"""The one runner starts the built-in worker like any program, and the env contract has one reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env
from torchlaunch import contract, runner
from torchlaunch.exit_codes import BAD_INPUT, BadInput


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=child_env(env), capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "torchlaunch.runner", "-m", "torchlaunch.worker"],  # what every launcher starts
        ["-m", "torchlaunch.worker"],  # what a user types (python -m train is the same module)
        ["-m", "train"],
    ],
)
def test_the_built_in_worker_ends_through_the_runner(command: list[str], tmp_path: Path) -> None:
    """Bad input in the worker: one line, exit 2, and the status record the launcher reads."""
    env = {"TORCHLAUNCH_ATTEMPT_ID": "t1", "TORCHLAUNCH_STATUS_DIR": str(tmp_path), "RANK": "3"}
    r = run([*command, "--config", "nope.yaml"], env)
    assert r.returncode == BAD_INPUT and r.stdout == ""
    assert r.stderr == ""  # under a launcher, the launcher prints the reason once for all ranks
    record = json.loads((tmp_path / "t1-rank3.json").read_text())
    assert record["code"] == BAD_INPUT and "nope.yaml" in record["reason"] and record["rank"] == 3
    alone = run([*command, "--config", "nope.yaml"])
    assert alone.returncode == BAD_INPUT and len(alone.stderr.splitlines()) == 1 and "nope.yaml" in alone.stderr


def test_the_preflight_ends_through_the_runner() -> None:
    r = run(["-m", "torchlaunch.tools.preflight", "--config", "nope.yaml"])
    lines = r.stderr.splitlines()
    assert r.returncode == BAD_INPUT
    assert len(lines) == 1 and lines[0].startswith("preflight: config error:") and "nope.yaml" in lines[0]


def test_builtins_are_the_projects_own_programs() -> None:
    assert runner.parse(["-m", "torchlaunch.worker", "--config", "x"]).builtin
    assert runner.parse(["-m", "torchlaunch.tools.preflight"]).builtin
    assert not runner.parse(["-m", "train"]).builtin  # a user's own `train` package is theirs
    assert not runner.parse(["train.py"]).builtin


def test_contract_reader() -> None:
    assert contract.read_env({}) is None
    full = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    full |= {"MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert contract.read_env(full) == {**{k: int(v) for k, v in full.items() if k != "MASTER_ADDR"}, "MASTER_ADDR": "h"}
    with pytest.raises(BadInput, match="LOCAL_RANK"):
        contract.read_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(BadInput, match="outside WORLD_SIZE"):
        contract.read_env({**full, "RANK": "2"})
    assert contract.rank({"RANK": "5"}) == 5 and contract.rank({"RANK": ""}) == 0 and contract.rank({}) == 0
    assert contract.rank({"RANK": "x"}) == 0 and contract.local_rank({"LOCAL_RANK": "2"}) == 2
    assert contract.is_main({}) and not contract.is_main({"RANK": "1"})


def test_nothing_else_reads_the_contract_from_the_environment() -> None:
    """One reader: no module but torchlaunch/contract.py looks RANK, LOCAL_RANK or WORLD_SIZE up."""
    readers = []
    for path in (REPO / "torchlaunch").rglob("*.py"):
        if path.name == "contract.py":
            continue
        text = path.read_text()
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            for form in (f'environ.get("{key}"', f'environ["{key}"]', f'env.get("{key}"', f'getenv("{key}"'):
                if form in text:
                    readers.append(f"{path.relative_to(REPO)}: {form}")
    assert readers == []


SITECUSTOMIZE = """import atexit, os
atexit.register(lambda: open(os.environ["TEARDOWN_MARK"], "w").close())
"""


@pytest.mark.parametrize(
    ("program", "torn_down"),
    [
        (["-m", "torchlaunch.worker", "--config", "nope.yaml"], False),  # the project's own: os._exit
        (["{script}"], True),  # a user's program: the interpreter's normal exit, its atexit handlers run
    ],
    ids=["built-in-worker", "user-script"],
)
def test_the_runner_decides_how_to_leave_from_the_program_it_was_given(
    program: list[str], torn_down: bool, tmp_path: Path
) -> None:
    """`python -m torchlaunch.runner PROGRAM` (every launcher's rank command) leaves the built-in worker's
    rank without interpreter teardown: the runner read the program after running it, when runpy had
    rewritten sys.argv to the program's own, so every built-in rank went through the full teardown.
    Seen from outside: an atexit handler (installed by a sitecustomize on PYTHONPATH) runs for a
    user's program only."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp_path / "user.py"
    script.write_text("print('user program ran')\n")
    mark = tmp_path / "atexit-ran"
    argv = [a.replace("{script}", str(script)) for a in program]
    r = run(
        ["-m", "torchlaunch.runner", *argv],
        {"TEARDOWN_MARK": str(mark), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
    )
    assert r.returncode == (0 if torn_down else BAD_INPUT), r.stderr
    assert mark.exists() == torn_down, (mark.exists(), r.stderr)


def test_run_as_main_takes_the_program_before_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The words exit_process decides on are the runner's arguments, whatever the program did to sys.argv."""
    decided: list[object] = []

    def program_rewrites_argv(argv: list[str]) -> int:
        sys.argv[:] = ["/somewhere/worker.py", "--config", "x.yaml"]  # what runpy does
        return 0

    monkeypatch.setattr(sys, "argv", ["runner", "-m", runner.BUILTIN_WORKER, "--config", "x.yaml"])
    monkeypatch.setattr(runner, "main", program_rewrites_argv)
    monkeypatch.setattr(runner, "exit_process", lambda code, program: decided.append((code, list(program))))
    runner.run_as_main()
    assert decided == [(0, ["-m", runner.BUILTIN_WORKER, "--config", "x.yaml"])]
