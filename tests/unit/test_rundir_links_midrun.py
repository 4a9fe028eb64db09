"""A link planted in a run dir while the run trains is not written through (issue 38, item 3, after the
start's checks): a folder the run writes in (checkpoints/, a step folder being committed, job/,
progress/, status/, hangs/) renamed away and replaced by a symlink to a folder outside. The checkpoint
commit works relative to RUN_DIR/checkpoints opened O_NOFOLLOW at the save's start and re-checks that
path before each rename; the run dir's writer opens a run-dir folder O_NOFOLLOW. In process: the store
and the writers are called directly, the swap made where a run would be in the middle of it."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from torchlaunch import rundir, status
from torchlaunch.core.checkpoint import store
from torchlaunch.jobs import record, watchdog


def outside_folder(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("not yours\n")
    return outside


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` with its bytes (None for a folder): what a write through a link changes."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def swap_for_link(folder: Path, target: Path) -> Path:
    """What an attacker with write access to the run dir does mid-run: the real folder renamed away, a
    symlink to `target` in its place. Returns where the real folder went."""
    moved = folder.with_name(folder.name + ".moved")
    os.rename(folder, moved)
    folder.symlink_to(target)
    return moved


def save(root: Path, step: int, before_commit=None) -> store.CommitInfo:  # noqa: ANN001 - a test hook
    return store.write_checkpoint(root, step, {"w": torch.arange(4.0) * step}, {}, before_commit=before_commit)


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_checkpoints_swapped_for_a_link_between_two_saves_is_not_written_through(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    root = rundir.checkpoints(run_dir)
    first = save(root, 1)
    outside = outside_folder(tmp_path)
    before = listing(outside)
    moved = swap_for_link(root, outside)
    with pytest.raises(Exception) as refused:  # noqa: PT011 - the store's one-line refusal, whatever its class
        save(root, 2)
    assert "symlink" in one_line(refused.value)
    assert listing(outside) == before
    assert store.verify(moved / first.path.name) is None  # the previous checkpoint is intact


def test_checkpoints_swapped_for_a_link_during_a_save_is_not_committed_through_it(tmp_path: Path) -> None:
    """Before (ad98e10): the commit renamed and wrote the marker by path, so with the attacker's copy of
    the temp folder's name in the target, step 2 was committed into the outside folder."""
    run_dir = tmp_path / "run"
    root = rundir.checkpoints(run_dir)
    first = save(root, 1)
    outside = outside_folder(tmp_path)

    def swap(tmp: Path) -> None:  # after the state is written, before the commit
        (outside / tmp.name).mkdir()  # names are readable in the run dir: the attacker mirrors the temp folder
        swap_for_link(root, outside)

    with pytest.raises(store.CheckpointStorageError) as refused:
        save(root, 2, before_commit=swap)
    line = one_line(refused.value)
    assert "was replaced while the run trained" in line and "step 2 is abandoned" in line, line
    assert sorted(p.name for p in outside.iterdir()) == sorted(["victim.txt", next(outside.glob(".tmp-*")).name])
    assert list(outside.glob(".tmp-*/*")) == []  # nothing committed or written there
    moved = root.with_name(root.name + ".moved")
    assert sorted(p.name for p in moved.iterdir()) == [first.path.name]  # no temp folder left, step 1 intact
    assert store.verify(moved / first.path.name) is None


def test_a_step_folder_swapped_for_a_link_during_a_save_gets_no_marker_through_it(tmp_path: Path) -> None:
    """Before (ad98e10): the temp folder renamed to step-N was the link, and COMMITTED.json went into its
    target."""
    root = rundir.checkpoints(tmp_path / "run")
    first = save(root, 1)
    outside = outside_folder(tmp_path)
    before = listing(outside)
    with pytest.raises(store.CheckpointStorageError) as refused:
        save(root, 2, before_commit=lambda tmp: swap_for_link(tmp, outside))
    assert "symlink" in one_line(refused.value)
    assert listing(outside) == before
    assert not os.path.lexists(root / store.step_dir_name(2))  # the link is not left as a step folder
    assert store.verify(first.path) is None and store.latest_valid(root) == first.path


@pytest.mark.parametrize("folder", [rundir.JOB, rundir.PROGRESS, rundir.STATUS])
def test_a_run_dir_folder_swapped_for_a_link_mid_run_is_not_written_through(tmp_path: Path, folder: str) -> None:
    """Before (ad98e10): the job record's end, a heartbeat and a rank's status record were written by
    path, into the link's target."""
    run_dir = tmp_path / "run"
    rec = record.start(run_dir, scheduler="local", command=["x"], launch_id="a1", nnodes=1, local_ranks=1)
    (run_dir / rundir.PROGRESS).mkdir()
    (run_dir / rundir.STATUS).mkdir()
    outside = outside_folder(tmp_path)
    before = listing(outside)
    swap_for_link(run_dir / folder, outside)
    with pytest.raises(rundir.LinkedFolder) as refused:
        if folder == rundir.JOB:
            record.finish(run_dir, rec, 0, "finished")
        else:
            target = run_dir / folder / ("rank-0.json" if folder == rundir.PROGRESS else "a1-rank0.json")
            rundir.write_json(target, {"step": 3}, durable=False, real_folder=True)
    assert "is a symlink now" in one_line(refused.value.strerror)
    assert listing(outside) == before


def test_the_heartbeat_and_the_status_record_skip_a_linked_folder_without_stopping_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their writers treat the refusal as the failed write it is (advisory files): nothing outside."""
    run_dir = tmp_path / "run"
    outside = outside_folder(tmp_path)
    before = listing(outside)
    (run_dir / rundir.STATUS).mkdir(parents=True)
    swap_for_link(run_dir / rundir.STATUS, outside)
    monkeypatch.setenv(status.ATTEMPT_ENV, "a1")
    monkeypatch.setenv(status.STATUS_DIR_ENV, str(run_dir / rundir.STATUS))
    status.report(0, 0, "finished", finished=True)
    assert listing(outside) == before


def test_hang_dumps_are_not_written_through_a_linked_hangs_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / rundir.HANGS).mkdir(parents=True)
    outside = outside_folder(tmp_path)
    before = listing(outside)
    swap_for_link(run_dir / rundir.HANGS, outside)
    verdict = watchdog.Verdict(True, (0,), 700.0, "no rank progressed for 700s")
    with pytest.raises(rundir.LinkedFolder):
        watchdog.dump_stacks(run_dir, [], verdict, wait_s=0, err=io.StringIO())
    assert listing(outside) == before


def test_retention_deletes_nothing_through_a_checkpoints_folder_swapped_for_a_link(tmp_path: Path) -> None:
    """Before (ad98e10): retention listed the link's target and deleted its step folders."""
    outside_run = tmp_path / "other-run"
    save(rundir.checkpoints(outside_run), 1)
    victim = save(rundir.checkpoints(outside_run), 2).path.parent  # keep=1 would delete its step 1
    before = listing(victim)
    root = rundir.checkpoints(tmp_path / "run")
    save(root, 5)
    swap_for_link(root, victim)
    warned: list[str] = []
    assert store.retain(root, 1, None, on_warn=warned.append) == []
    assert listing(victim) == before and len(warned) == 1 and "symlink" in warned[0]


def test_a_linked_trace_folder_is_refused_in_one_line_before_the_trace_is_opened(tmp_path: Path) -> None:
    """Before (ad98e10): RUN_DIR/trace was no folder of rundir's (not checked at start) and each rank's
    batch trace was created in the link's target."""
    from torchlaunch.exit_codes import BadInput
    from torchlaunch.worker.metrics import RunLog

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outside = outside_folder(tmp_path)
    before = listing(outside)
    (run_dir / "trace").symlink_to(outside)  # the name as the worker has always written it
    with pytest.raises(BadInput) as refused:
        RunLog(
            run_dir,
            1,
            epochs=1,
            steps_per_epoch=1,
            total_steps=1,
            global_batch=1,
            start_step=0,
            resume_step=None,
            tensorboard=False,
            trace=True,
        )
    assert "RUN_DIR/trace must be a real folder" in one_line(refused.value)
    assert listing(outside) == before
    with pytest.raises(BadInput, match="trace"):
        rundir.check_folders(run_dir)  # and the launchers' start check names it


class _SwapsMidWrite:
    """A checkpoint format that opens its files by path, as formats do; between its two files the
    checkpoints folder is swapped for a link (the attacker mirrors the temp folder's name there)."""

    name = "swaps_mid_write"

    def __init__(self, root: Path, outside: Path) -> None:
        self.root, self.outside = root, outside

    def write(self, tmp_dir: Path, state: dict) -> dict:  # type: ignore[type-arg]
        (tmp_dir / "part-0").write_bytes(b"first")
        mirror = next(p.name for p in self.root.iterdir() if p.name.startswith(store.TMP_PREFIX))
        (self.outside / mirror).mkdir()
        swap_for_link(self.root, self.outside)
        (tmp_dir / "part-1").write_bytes(b"second")
        return {"checksum": "xxh3_128:0", "bytes": 11}


def test_a_format_writing_by_path_writes_nothing_through_checkpoints_swapped_mid_write(tmp_path: Path) -> None:
    """The store hands a format the temp folder as a path pinned to the folder it holds open, so the
    guarantee is the store's, not each format's: the second file lands in the real temp folder (not in
    the link's target), and the commit is refused at its check."""
    from torchlaunch.core.checkpoint import formats

    root = rundir.checkpoints(tmp_path / "run")
    first = save(root, 1)
    outside = outside_folder(tmp_path)
    fmt = formats.register_format(_SwapsMidWrite(root, outside))
    try:
        with pytest.raises(store.CheckpointStorageError) as refused:
            store.write_checkpoint(root, 2, {}, {}, format_name=fmt.name)
    finally:
        formats.unregister_format(fmt.name)
    assert "was replaced while the run trained" in one_line(refused.value)
    assert list(outside.glob(".tmp-*/*")) == []  # neither file went through the link
    moved = root.with_name(root.name + ".moved")
    assert sorted(p.name for p in moved.iterdir()) == [first.path.name]  # temp folder removed, step 1 intact
    assert store.verify(moved / first.path.name) is None


def test_the_single_file_format_never_follows_a_link_planted_in_the_temp_folder(tmp_path: Path) -> None:
    """formats.create_new: a name already taken, a link included, is refused, not opened."""
    from torchlaunch.core.checkpoint import formats

    outside = outside_folder(tmp_path)
    folder = tmp_path / "tmp-folder"
    folder.mkdir()
    (folder / store.STATE_FILE).symlink_to(outside / "victim.txt")
    with pytest.raises(FileExistsError):
        formats.create_new(folder / store.STATE_FILE)
    assert (outside / "victim.txt").read_text() == "not yours\n"
