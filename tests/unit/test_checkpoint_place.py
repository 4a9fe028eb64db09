"""A checkpoint's place is not trusted (issue 28, cause 4): the folder's step, the marker's step, the
state's step and the run it belongs to agree, or the checkpoint is skipped for the previous one with a
warning; a state that cannot be restored is skipped like a corrupt one; `checkpoints` is a real folder
of the run dir; a newer format is refused in one line and never moved. Real files, one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.dist import DistContext
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.state_check import worker_state_problem


def payload(step: int) -> dict:
    """What the built-in worker saves, in miniature."""
    return {
        "model": {"w": torch.full((4,), float(step))},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {},
        "scaler": {},
        "progress": {
            "epoch": 0,
            "step_in_epoch": step,
            "global_step": step,
            "val_pending": False,
            "best_val_acc": None,
            "last_val": {},
        },
        "global_batch": 8,
    }


def checkpointer(run: Path) -> ckpt.Checkpointer:
    return ckpt.Checkpointer(DistContext(), run / "checkpoints", 3, ckpt.WORKER_KIND, check_state=worker_state_problem)


def save(run: Path, *steps: int, edit=None) -> None:  # noqa: ANN001 - an optional payload editor
    for step in steps:
        state = payload(step)
        if edit is not None:
            edit(state)
        checkpointer(run).save(step, state, synchronous=True)


def resumed(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int | None, str]:
    loaded = checkpointer(run).load_latest(restore=False)
    return (loaded.step if loaded else None), capsys.readouterr().err


def test_a_copy_renamed_to_a_later_step_does_not_pin_resume(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    save(run, 10, 20)
    root = run / "checkpoints"
    shutil.copytree(root / "step-000000010", root / "step-000999999")
    step, err = resumed(run, capsys)
    assert step == 20
    assert "step-000999999" in err and "marker is of step 10" in err and err.count("warning") == 1
    assert not (root / "step-000999999").exists()  # moved aside once, not met at every resume
    save(run, 30)
    assert resumed(run, capsys)[0] == 30


def test_a_state_of_another_step_than_its_folder_and_marker_is_skipped(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    save(run, 10, 20)
    root = run / "checkpoints"
    forged = root / "step-000999999"
    shutil.copytree(root / "step-000000010", forged)
    marker = json.loads((forged / ckpt.MARKER_FILE).read_text())
    (forged / ckpt.MARKER_FILE).write_text(json.dumps({**marker, "step": 999999}))  # a consistent forgery
    step, err = resumed(run, capsys)
    assert step == 20 and "its state is of step 10" in err


def test_a_checkpoint_copied_from_another_run_is_not_resumed(tmp_path: Path, capsys) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    save(mine, 10)
    save(other, 50)
    shutil.copytree(other / "checkpoints" / "step-000000050", mine / "checkpoints" / "step-000000050")
    step, err = resumed(mine, capsys)
    assert step == 10 and "belongs to run" in err
    assert (other / "checkpoints" / "step-000000050").is_dir()  # the other run keeps its own


@pytest.mark.parametrize("dangling", [False, True])
def test_checkpoints_symlinked_elsewhere_is_one_line_and_touches_nothing(tmp_path: Path, dangling: bool) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    save(other, 1, 2, 3, 4)
    before = sorted(p.name for p in (other / "checkpoints").iterdir())
    mine.mkdir()
    target = tmp_path / "gone" if dangling else other / "checkpoints"
    (mine / "checkpoints").symlink_to(target)
    with pytest.raises(BadInput, match="is a symlink to") as info:
        checkpointer(mine).load_latest(restore=False)
    assert "\n" not in str(info.value)
    with pytest.raises(BadInput, match="is a symlink to"):  # a save refuses too (was FileExistsError, exit 1)
        checkpointer(mine).save(9, payload(9), synchronous=True)
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == before


def test_a_symlinked_step_folder_is_not_a_candidate(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    save(mine, 1)
    save(other, 9)
    (mine / "checkpoints" / "step-000000009").symlink_to(other / "checkpoints" / "step-000000009")
    assert [s for s, _ in ckpt.candidates(mine / "checkpoints")] == [1]


def _drop_model(state: dict) -> None:
    del state["model"]


def _wrong_type(state: dict) -> None:
    state["progress"]["global_step"] = "twenty"


@pytest.mark.parametrize("edit", [_drop_model, _wrong_type], ids=["missing-model", "wrong-type"])
def test_a_structurally_invalid_state_falls_back_like_a_corrupt_one(tmp_path: Path, capsys, edit) -> None:  # noqa: ANN001
    run = tmp_path / "run"
    save(run, 10)
    save(run, 20, edit=edit)  # checksum-valid, not restorable
    step, err = resumed(run, capsys)
    assert step == 10 and "its state is not usable" in err and "falling back" in err


def test_a_bad_rng_tensor_falls_back_like_a_corrupt_one(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    save(run, 10, 20)
    folder = run / "checkpoints" / "step-000000020"
    state = torch.load(folder / ckpt.STATE_FILE, weights_only=True)
    state["rng"][0]["torch"] = torch.zeros(3, dtype=torch.uint8)  # torch.set_rng_state would raise
    torch.save(state, folder / ckpt.STATE_FILE)
    marker = json.loads((folder / ckpt.MARKER_FILE).read_text())
    marker.update(
        checksum=ckpt.file_checksum(folder / ckpt.STATE_FILE), bytes=(folder / ckpt.STATE_FILE).stat().st_size
    )
    (folder / ckpt.MARKER_FILE).write_text(json.dumps(marker))
    step, err = resumed(run, capsys)
    assert step == 10 and "RNG states" in err


def test_a_newer_format_is_refused_in_one_line_and_never_moved(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save(run, 10, 20)
    folder = run / "checkpoints" / "step-000000020"
    marker = json.loads((folder / ckpt.MARKER_FILE).read_text())
    (folder / ckpt.MARKER_FILE).write_text(json.dumps({**marker, "format_version": ckpt.FORMAT_VERSION + 1}))
    with pytest.raises(BadInput, match="newer torchlaunch") as info:
        checkpointer(run).load_latest(restore=False)
    assert "format_version 2" in str(info.value) and "\n" not in str(info.value)
    assert folder.is_dir() and not (run / "checkpoints" / ckpt.QUARANTINE_DIR).exists()
    ckpt.apply_retention(run / "checkpoints", keep=2)  # retention leaves it too
    assert folder.is_dir() and not (run / "checkpoints" / ckpt.QUARANTINE_DIR).exists()


def test_a_deep_or_huge_marker_is_a_skipped_checkpoint_not_a_recursion_error(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    save(run, 10, 20)
    marker = run / "checkpoints" / "step-000000020" / ckpt.MARKER_FILE
    marker.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested more than" in (ckpt.verify(marker.parent) or "")
    step, err = resumed(run, capsys)
    assert step == 10 and "nested more than" in err
    save(run, 30)
    big = run / "checkpoints" / "step-000000030" / ckpt.MARKER_FILE
    big.write_text(" " * (ckpt.MAX_MARKER_BYTES + 1))
    assert "larger than" in (ckpt.verify(big.parent) or "")


def test_deep_rank_records_and_lock_records_are_unreadable_not_a_recursion_error(tmp_path: Path) -> None:
    from torchlaunch import runlock, status

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "a1-rank0.json").write_text(deep)
    assert status.records(tmp_path, "a1") == []
    (tmp_path / ".lock.json").write_text(deep)
    assert runlock.read_holder(tmp_path / ".lock.json").token == runlock.UNREADABLE


def test_a_damaged_run_identity_is_refused_at_resume_and_moves_nothing(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    save(run, 10, 20)
    (run / ckpt.RUN_ID_FILE).write_text('{"run_id": "not hex", "created_at": 1}')
    with pytest.raises(BadInput, match="run_id.json is not a run identity"):
        checkpointer(run).load_latest(restore=False)
    assert [s for s, _ in ckpt.candidates(run / "checkpoints")] == [20, 10]
    assert ckpt.latest_valid(run / "checkpoints") == run / "checkpoints" / "step-000000020"  # readers carry on
