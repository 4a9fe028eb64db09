"""The harness's pure parts, without root or namespaces: run-dir probes and the report renderer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults import progress, report


def write_checkpoint(root: Path, name: str, state_bytes: int, committed: bool) -> None:
    folder = root / "checkpoints" / name
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"x" * state_bytes)
    if committed:
        (folder / "COMMITTED.json").write_text("{}")


def test_train_steps_skip_validation_and_torn_lines(tmp_path):
    lines = [{"step": 1, "epoch": 0, "loss": 2.0}, {"step": 2, "epoch": 0, "val_loss": 1.0, "val_acc": 0.5}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    assert progress.train_steps(tmp_path) == [1]
    assert progress.last_step(tmp_path / "missing") == -1


def test_partial_writes_are_new_uncommitted_steps_or_temp_folders(tmp_path):
    write_checkpoint(tmp_path, "step-000000004", 10, committed=True)
    write_checkpoint(tmp_path, "step-000000002", 10, committed=False)  # retention deleting an old one
    write_checkpoint(tmp_path, "step-000000008", 7, committed=False)  # marker not written yet
    write_checkpoint(tmp_path, ".tmp-step-000000004-99-abcd", 3, committed=False)  # replacing step 4
    assert progress.committed_checkpoints(tmp_path) == [4]
    caught = {w.entry: w.files for w in progress.partial_writes(tmp_path)}
    assert caught == {"step-000000008": {"state.pt": 7}, ".tmp-step-000000004-99-abcd": {"state.pt": 3}}


def test_wait_until_is_bounded_and_can_give_up_early():
    with pytest.raises(TimeoutError):
        progress.wait_until(lambda: False, 0.1, "never")
    with pytest.raises(RuntimeError, match="node died"):
        progress.wait_until(lambda: False, 10, "never", abort=lambda: "node died")


def outcome(fault: str, **fields: object) -> dict:
    base = {
        "fault": fault,
        "fault_step": 5,
        "first_codes": [0, 0],
        "failure_s": None,
        "recover_s": None,
        "resumed_from": None,
        "steps_lost": 0,
        "rerun_codes": None,
        "model_equal": True,
        "notes": [],
    }
    return base | fields


def test_report_renders_rows_in_order_and_marks_unequal_models():
    results = {
        "kill-node": outcome(
            "kill node",
            first_codes=[1, -9],
            failure_s=4.94,
            recover_s=22.3,
            rerun_codes=[0, 0],
            resumed_from=4,
            steps_lost=4,
            model_equal=False,
            notes=["killed 3"],
        ),
        "preempt": outcome("preempt", first_codes=[75, 75], failure_s=6.2, rerun_codes=[0, 0], resumed_from=11),
    }
    table = report.render(results, seed="9")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows[0].startswith("| preempt | exit 75/75; rerun exit 0/0 | yes | 6.2 s |")
    assert "| **no** | 4.9 s | 22.3 s | step 4 | 4 |" in rows[1]
    assert "FAULTS_SEED=9" in rows[1] and "-k killed_node" in rows[1]
    assert "killed 3" in table


def test_report_replaces_only_the_marked_block(tmp_path):
    doc = tmp_path / "R.md"
    doc.write_text(f"intro\n{report.START}\nold\n{report.END}\noutro\n")
    report.write_into(doc, "| new |\n")
    assert doc.read_text() == f"intro\n{report.START}\n| new |\n{report.END}\noutro\n"
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        report.write_into(tmp_path / "bare.md", "x")


def test_the_resumed_line_the_trainer_prints_is_read_back() -> None:
    """The scenarios learn where a rerun resumed from the worker's own line; its wording is the
    Trainer's (epochs and steps "N/total" since the console counts them that way), so a change there
    must show here, not as a resumed_from of None in every netns scenario."""
    import inspect

    from faults.scenarios import resumed_steps
    from torchlaunch.worker.trainer import Trainer

    source = inspect.getsource(Trainer._opening_line)
    assert "at epoch {p.epoch + 1}/{self.cfg.train.epochs} step {p.step_in_epoch}/" in source
    line = "rank 0: resumed from /r/checkpoints/step-000000012 at epoch 2/3 step 4/8 (global step 12)"
    assert resumed_steps(line + "\n" + line.replace("12)", "16)")) == [12, 16]
