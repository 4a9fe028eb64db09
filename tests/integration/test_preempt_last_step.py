"""A preemption agreed at the run's last training step: the rerun still validates and writes the
final checkpoint, and ends bit for bit where the uninterrupted run ends.

The per-step agreement is read two steps late or at the next check point, so a signal in the last
steps of a run is agreed exactly at its last step (a check point): the case this covers. A signal
seen while the last step is in flight drops that step instead (core/step_drop.py: the stop commits
the step before; test_outside_stops_local covers it), so the signal comes once the last step has trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import assert_models_equal, assert_states_equal, final_state
from tests.integration.test_resume import TOTAL_STEPS, run
from tests.library import RunLibrary

pytestmark = pytest.mark.slow


def _validations(run_dir: Path) -> list[dict]:
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_acc" in r]


def test_signal_before_the_last_step_then_rerun_validates_and_matches(tmp_path: Path, run_library: RunLibrary) -> None:
    """The reference is test_resume.py's uninterrupted run (the same recipe), from the session's library:
    read only here; its exit code is asserted where it is built (tests/library.py)."""
    reference, resumed = run_library.path("resume"), tmp_path / "resumed"
    first = run(resumed, env={"TORCHLAUNCH_FAULT_SIGNAL": f"at=step,n={TOTAL_STEPS},rank=1"})
    assert first.returncode == 75, first.stderr[-2000:]
    stopped = final_state(resumed)
    assert stopped["progress"]["global_step"] == TOTAL_STEPS and stopped["progress"]["val_pending"]
    second = run(resumed)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "validation: loss" in second.stdout + second.stderr
    a, b = final_state(reference), final_state(resumed)
    assert_states_equal(a, b)
    assert not b["progress"]["val_pending"] and b["progress"]["last_val"] == a["progress"]["last_val"]
    assert_models_equal(reference / "model.pt", resumed / "model.pt")
    assert _validations(resumed)[-1]["step"] == TOTAL_STEPS
    assert [v["val_acc"] for v in _validations(resumed)] == [v["val_acc"] for v in _validations(reference)]
