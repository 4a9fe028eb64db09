"""What a new user's first commands met (issue 51), the halves that start processes: make's recipes
(a stand-in interpreter says what they ran and how it ended, so no test suite or training runs
inside these tests), the commands outside .venv, and a rerun of a finished run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cmd
from tests.unit.test_first_run import finished_run
from tests.unit.test_readme_commands import scratch_copy
from torchlaunch import config as config_mod
from torchlaunch import rundir

STAND_IN = """#!/bin/sh
# a stand-in for .venv/bin/python: logs its arguments, exits with the next code of CODES
echo "$*" >> "{log}"
n=$(wc -l < "{log}")
code=$(echo "{codes}" | cut -d' ' -f"$n")
exit "${{code:-0}}"
"""


def make(tmp_path: Path, target: str, codes: str, *args: str) -> tuple[int, str, list[str]]:
    """`make TARGET` with PY a stand-in exiting CODES (one per call, in order); (code, stderr, its calls).
    `-o VENV/.installed` tells make the install step is done: nothing is installed."""
    log = tmp_path / "calls.log"
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN.format(log=log, codes=codes))
    stand_in.chmod(0o755)
    venv = Path(sys.prefix)
    command = ["make", "-C", str(REPO), "--no-print-directory", "-o", f"{venv}/.installed", f"VENV={venv}"]
    rc, _, err = run_cmd([*command, f"PY={stand_in}", target, *args], timeout=60)
    return rc, err, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("target", ["test-integration", "test-extended"])
def test_a_failing_first_stage_does_not_hide_the_second(tmp_path: Path, target: str) -> None:
    rc, err, calls = make(tmp_path, target, "1 0")
    assert len(calls) == 2 and "netns" in calls[1], calls
    assert rc != 0, err  # the first stage's failure still fails the target
    (tmp_path / "second").mkdir()
    rc, _, calls = make(tmp_path / "second", target, "0 1")
    assert rc != 0 and len(calls) == 2


def test_make_train_local_says_the_launchers_own_exit_code(tmp_path: Path) -> None:
    """make turns any failing recipe into its own exit 2; the README's table reads the launcher's 75
    ("run the same command again"), so the recipe says it."""
    rc, err, calls = make(tmp_path, "train-local", "75", "CONFIG=configs/smoke.yaml")
    assert calls and "-m launch.local" in calls[0]
    assert rc == 2 and "launch.local exited 75" in err, err
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "launch.local exited" in readme or "make's own" in readme


def test_outside_the_venv_a_command_is_one_line_and_leaves_a_finished_run_alone(tmp_path: Path) -> None:
    """`python -S` has no site-packages: the system Python of a user who did not activate .venv. A
    command that needs the packages says what is missing and how to use .venv in one line, exit 2; one
    that can do without (status, its checkpoints left unverified) works; the finished run's
    record is not rewritten (a started attempt relabelled it `failed`)."""
    run = tmp_path / "run"
    job = finished_run(run)
    kept = job.read_bytes()
    for command in (
        ["launch.local", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml", f"run_dir={run}"],
        ["train.shards", "write", "--help"],
    ):
        rc, _, err = run_cmd([sys.executable, "-S", "-m", *command], timeout=60)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, err[-2000:]
        assert lines[0].startswith("env error:") and ".venv/bin/python -m" in lines[0]
    (rundir.checkpoints(run) / "step-000000048").mkdir(parents=True)  # to verify, torch would be needed
    rc, out, err = run_cmd([sys.executable, "-S", "-m", "launch", "status", str(run)], timeout=60)
    assert rc == 0 and "finished" in out and "checkpoints not verified: this Python lacks" in out, err[-2000:]
    assert job.read_bytes() == kept


def test_the_suite_is_green_after_the_quick_starts_first_command(tmp_path: Path) -> None:
    """In a copy of the checkout, runs/smoke holds the smoke recipe as the quick start's `make
    train-local GPUS=2 CONFIG=configs/smoke.yaml` wrote it; the tests that met it there (a dry run of
    the smoke recipe with other values: "was started with another config") pass, in their own run dirs."""
    tree = scratch_copy(tmp_path / "tree")
    cfg = config_mod.load(str(tree / "configs" / "smoke.yaml"), [f"run_dir={tree / 'runs' / 'smoke'}"])
    config_mod.write_resolved(cfg)  # the user's run: the recipe as it is, no overrides
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy's code, not this checkout's
    tests = [
        "tests/integration/test_launcher_front_refusals.py::test_overrides_mix_with_options",
        "tests/unit/test_first_run.py",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "seed: 7" not in rundir.config(cfg.run_dir).read_text()  # the user's run dir was never written
