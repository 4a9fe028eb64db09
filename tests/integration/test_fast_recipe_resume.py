"""test_fast_recipe_resume: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_fast_recipe.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import assert_models_equal, assert_states_equal, final_state, launcher
from tests.unit.test_fast93 import RECIPE as FAST93_RECIPE
from tests.unit.test_fast_recipe import RECIPE
from torchlaunch.exit_codes import OK, PREEMPTED


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "fault_step", "said", "check"),
    [
        # Lookahead's average is part of the checkpoint.
        pytest.param(
            RECIPE, 11, "test-time augmentation flip_translate", lambda a: a["lookahead"] is not None, id="fast"
        ),
        # A kill mid-epoch, after a cutout step and before the next checkpoint.
        pytest.param(
            FAST93_RECIPE,
            7,
            "fastnet93",
            lambda a: a["config"]["data"]["cutout"] == 12,
            id="fast93",
            marks=pytest.mark.extended,
        ),
    ],
)
def test_a_fast_recipe_resumes_bit_for_bit(
    recipe: list[str], fault_step: int, said: str, check: Callable[[dict], bool], tmp_path: Path
) -> None:
    """An interrupted run of each fast recipe ends where an uninterrupted one does, bit for bit."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    done = launcher(["--gpus", "2", *recipe, f"run_dir={reference}"])
    assert done.returncode == OK, done.stderr[-2000:]
    assert said in done.stdout + done.stderr
    first = launcher(
        ["--gpus", "2", *recipe, f"run_dir={resumed}"],
        env={"TORCHLAUNCH_FAULT_SIGNAL": f"at=step,n={fault_step},rank=1"},
    )
    assert first.returncode == PREEMPTED, first.stderr[-2000:]
    second = launcher(["--gpus", "2", *recipe, f"run_dir={resumed}"])
    assert second.returncode == OK, second.stderr[-2000:]
    a, b = final_state(reference), final_state(resumed)
    assert_states_equal(a, b)
    assert check(a)
    assert_models_equal(reference / "model.pt", resumed / "model.pt")
