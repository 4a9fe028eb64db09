"""The one runner starts the built-in worker like any program, and the env contract has one reader."""

from __future__ import annotations

import json
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
