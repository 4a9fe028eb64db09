"""test_runner_contract_ends: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_runner_contract.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.test_runner_contract import SITECUSTOMIZE, run
from torchlaunch.exit_codes import BAD_INPUT


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
