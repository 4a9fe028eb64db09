"""One answer to "which checkpoint does this path mean" and "which checkpoints count": locate(),
latest_valid(), retention that trusts only folders that verify, and checkpoints written before the
Trainer and the API shared one Checkpointer (tests/fixtures/checkpoint_v1)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchlaunch.core import checkpoint as ckpt
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker import init_from

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"


def state(value: int) -> dict:
    return {"format_version": ckpt.FORMAT_VERSION, "w": torch.full((8, 8), float(value)), "step": value}


def corrupt(folder: Path) -> None:
    """Flip one byte of the state file; the marker (size, checksum) stays: an interrupted or damaged copy."""
    f = folder / ckpt.STATE_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def forge(root: Path, step: int) -> Path:
    """A folder whose marker matches its bytes (it verifies) but whose content the safe loader refuses."""

    class Evil:
        def __reduce__(self):  # noqa: ANN204 - what a crafted checkpoint would carry
            return (print, ("executed",))

    folder = root / ckpt.step_dir_name(step)
    folder.mkdir(parents=True)
    torch.save({"format_version": ckpt.FORMAT_VERSION, "evil": Evil()}, folder / ckpt.STATE_FILE)
    marker = {
        "step": step,
        "checksum": ckpt.file_checksum(folder / ckpt.STATE_FILE),
        "bytes": (folder / ckpt.STATE_FILE).stat().st_size,
        "format_version": ckpt.FORMAT_VERSION,
    }
    (folder / ckpt.MARKER_FILE).write_text(json.dumps(marker))
    assert ckpt.verify(folder) is None  # the attack: size and checksum are right
    return folder


# ------------------------------------------------------------------ locate / latest_valid


def test_locate_names_every_form(tmp_path: Path) -> None:
    run = tmp_path / "run"
    step = ckpt.write_checkpoint(run / "checkpoints", 5, state(5), {}).path
    weights = tmp_path / "w.pt"
    torch.save({"a": torch.ones(1)}, weights)
    assert ckpt.locate(run) == ckpt.Located(run, "run", run / "checkpoints")
    assert ckpt.locate(run / "checkpoints") == ckpt.Located(run / "checkpoints", "checkpoints", run / "checkpoints")
    assert ckpt.locate(step) == ckpt.Located(step, "step", run / "checkpoints", step)
    assert ckpt.locate(step / ckpt.STATE_FILE).checkpoint == step
    assert ckpt.locate(weights) == ckpt.Located(weights, "file")
    assert ckpt.locate(tmp_path / "nope") is None


def test_latest_valid_skips_what_does_not_verify_and_names_it(tmp_path: Path) -> None:
    good = ckpt.write_checkpoint(tmp_path, 3, state(3), {}).path
    bad = ckpt.write_checkpoint(tmp_path, 4, state(4), {}).path
    corrupt(bad)
    skipped: list[tuple[Path, str]] = []
    assert ckpt.latest_valid(tmp_path, lambda p, r: skipped.append((p, r))) == good
    assert skipped == [(bad, ckpt.CHECKSUM_MISMATCH)]


def test_verification_cache_notices_new_bytes(tmp_path: Path) -> None:
    folder = ckpt.write_checkpoint(tmp_path, 1, state(1), {}).path
    assert ckpt.verify(folder) is None
    corrupt(folder)  # same size, new bytes and modification time
    assert ckpt.verify(folder) == ckpt.CHECKSUM_MISMATCH


def test_a_marker_alone_does_not_make_a_run_resumable(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    only = ckpt.write_checkpoint(root, 2, state(2), {}).path
    assert init_from.will_resume("auto", root)
    corrupt(only)
    assert not init_from.will_resume("auto", root)  # resume would skip it: this is a fresh run
    assert init_from.will_resume(str(only), root)  # an explicit path is resumed (or refused) as asked
    assert not init_from.will_resume("never", root)


def test_resume_accepts_a_run_folder_and_refuses_one_without_valid_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt.write_checkpoint(run / "checkpoints", 3, state(3), {})
    newest = ckpt.write_checkpoint(run / "checkpoints", 4, state(4), {}).path
    path, loaded = ckpt.resolve_resume(str(run), tmp_path / "elsewhere")
    assert path == newest and loaded["step"] == 4
    corrupt(newest)
    assert ckpt.resolve_resume(str(run / "checkpoints"), tmp_path)[1]["step"] == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInput, match="holds no valid checkpoint"):
        ckpt.resolve_resume(str(empty), tmp_path)


# ------------------------------------------------------------------ retention


def test_two_corrupt_newer_folders_cannot_push_good_ones_out(tmp_path: Path, capsys) -> None:
    """An interrupted copy of a run folder: two newer-numbered folders with markers but bad bytes."""
    root = tmp_path
    good = ckpt.write_checkpoint(root, 3, state(3), {}).path
    for step in (100, 200):
        shutil.copytree(good, root / ckpt.step_dir_name(step))
        corrupt(root / ckpt.step_dir_name(step))
    committed = ckpt.write_checkpoint(root, 6, state(6), {}).path
    removed = ckpt.retain(root, keep=2, committed=committed)
    assert removed == []
    assert [s for s, _ in ckpt.candidates(root)] == [6, 3]
    assert sorted(p.name for p in (root / ckpt.QUARANTINE_DIR).iterdir()) == ["step-000000100", "step-000000200"]
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "step-000000100" in err and "step-000000200" in err
    assert ckpt.find_latest(root)[0] == committed


def test_a_forged_newer_checkpoint_is_not_counted(tmp_path: Path) -> None:
    root = tmp_path
    ckpt.write_checkpoint(root, 3, state(3), {})
    forged = forge(root, 999)
    committed = ckpt.write_checkpoint(root, 6, state(6), {}).path
    ckpt.retain(root, keep=2, committed=committed)
    assert [s for s, _ in ckpt.candidates(root)] == [999, 6, 3]  # it verifies: kept aside, not counted
    later = ckpt.write_checkpoint(root, 9, state(9), {}).path
    ckpt.retain(root, keep=2, committed=later)
    assert [s for s, _ in ckpt.candidates(root)] == [999, 9, 6]
    assert forged.exists()


def test_the_just_committed_checkpoint_is_never_deleted(tmp_path: Path) -> None:
    """Also when newer verified folders exist (a resume from an explicit older checkpoint)."""
    root = tmp_path
    for step in (10, 20, 30):
        ckpt.write_checkpoint(root, step, state(step), {})
    committed = ckpt.write_checkpoint(root, 11, state(11), {}).path
    ckpt.retain(root, keep=1, committed=committed)
    assert [s for s, _ in ckpt.candidates(root)] == [30, 20, 11]


def test_resume_moves_what_fails_to_load_to_quarantine(tmp_path: Path, capsys) -> None:
    from torchlaunch.core.dist import DistContext

    root = tmp_path / "checkpoints"
    ckpt.write_checkpoint(root, 3, state(3), {"kind": ckpt.WORKER_KIND})
    corrupt(ckpt.write_checkpoint(root, 4, state(4), {}).path)
    forge(root, 5)
    loaded = ckpt.Checkpointer(DistContext(), root, 2, ckpt.WORKER_KIND).load_latest(restore=False)
    assert loaded is not None and loaded.step == 3 and loaded.path.name == "step-000000003"
    assert sorted(p.name for p in (root / ckpt.QUARANTINE_DIR).iterdir()) == ["step-000000004", "step-000000005"]
    out, err = capsys.readouterr()
    assert "checksum mismatch" in err and "refused by the safe loader" in err and "executed" not in out


# ------------------------------------------------------------------ one format, old checkpoints still load


@pytest.fixture
def copied(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, target)
    yield target


def test_a_worker_checkpoint_of_format_1_resumes_the_trainer(copied: Path) -> None:
    from torchlaunch import config as config_mod
    from torchlaunch.core.dist import DistContext
    from torchlaunch.core.preemption import PreemptionWatcher
    from torchlaunch.worker.data import load_bundle
    from torchlaunch.worker.trainer import Trainer

    run = copied / "worker"
    old = ckpt.load_state(run / "checkpoints" / "step-000000002")
    assert "kind" not in old and "step" not in old  # written before the envelope named them
    overrides = [
        f"run_dir={run}",
        "data.synthetic_train_size=256",
        "data.synthetic_val_size=64",
        "train.batch_size=64",
        "train.epochs=1",
        "train.max_steps=2",
        "checkpoint.every_steps=1",
        "model.width=4",
    ]
    cfg = config_mod.load("configs/smoke.yaml", overrides)
    trainer = Trainer(cfg, DistContext(), load_bundle(cfg.data), PreemptionWatcher([]))
    assert trainer.resume() == run / "checkpoints" / "step-000000002"
    assert trainer.progress.global_step == 2
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, old["model"][key]), key
    torch_rng = old["rng"][0]["torch"]
    assert torch.equal(torch.get_rng_state(), torch_rng)  # this rank's RNG put back


def test_an_api_checkpoint_of_format_1_loads_through_the_facade(copied: Path, monkeypatch) -> None:
    from torchlaunch import api

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    api.setup()
    try:
        checkpointer = api.Checkpointer(copied / "api")
        loaded = checkpointer.load_latest()
        assert checkpointer.step == 4
        assert loaded["note"] == "old api" and loaded["n"] == 4
        assert torch.equal(loaded["w"], torch.arange(6.0).reshape(2, 3))
        checkpointer.save(5, {"n": 5}, synchronous=True)  # and the same folder takes new ones
        assert ckpt.load_state(copied / "api" / "checkpoints" / "step-000000005")["kind"] == api.KIND
    finally:
        api.teardown()


def test_a_worker_payload_refuses_reserved_keys(tmp_path: Path) -> None:
    from torchlaunch.core.dist import DistContext

    checkpointer = ckpt.Checkpointer(DistContext(), tmp_path, 1, ckpt.WORKER_KIND)
    with pytest.raises(ValueError, match="reserved"):
        checkpointer.save(1, {"rng": 1}, synchronous=True)
    assert not list(tmp_path.iterdir())
