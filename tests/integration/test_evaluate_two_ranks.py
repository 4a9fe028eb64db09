"""test_evaluate_two_ranks: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_evaluate.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cmd, torchrun_argv
from tests.unit.test_evaluate import (
    run_eval,
    setup,  # noqa: F401 (fixtures, used by name)
)


def evaluate_on_two_ranks(*args: str) -> tuple[int, str, str]:
    """`torchlaunch.worker.evaluate ARGS` under plain torchrun, 2 ranks of one thread each."""
    argv = torchrun_argv(2, "-m", "torchlaunch.worker.evaluate", *args)
    return run_cmd(argv, timeout=120, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_two_ranks_count_every_sample_once(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun each rank evaluates a contiguous shard (11 + 10 of 21): same numbers as one process."""
    rc, out, err = run_eval(["--run-dir", str(setup["run"]), "--data-root", str(setup["data"])], capsys)
    single = json.loads(out)
    rc, out, err = evaluate_on_two_ranks(
        "--run-dir", str(setup["run"]), "--data-root", str(setup["data"]), "--batch-size", "4"
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out  # only rank 0 prints
    report = json.loads(lines[0])
    assert report["samples"] == 21
    assert report["accuracy"] == pytest.approx(single["accuracy"], abs=1e-9)
    assert report["loss"] == pytest.approx(single["loss"], rel=1e-5)


@pytest.mark.slow
def test_two_ranks_agree_on_bad_input(setup: dict, tmp_path: Path) -> None:
    rc, out, err = evaluate_on_two_ranks("--run-dir", str(setup["run"]), "--data-root", str(tmp_path / "missing"))
    assert rc != 0 and out == ""
    assert sum("does not exist" in ln for ln in err.splitlines()) == 1  # printed once, by rank 0
