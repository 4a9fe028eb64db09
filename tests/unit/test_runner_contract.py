"""The one runner starts the built-in worker like any program, and the env contract has one reader."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, child_env
from torchlaunch import contract, runner
from torchlaunch.exit_codes import BadInput


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=child_env(env), capture_output=True, text=True, timeout=60
    )


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
