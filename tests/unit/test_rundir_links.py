"""Nothing is written, appended or deleted through a folder of a run dir (or a shard set's output) that
links out of it (issue 38, item 3): each folder the third hostile round wrote through is a real symlink
here to a folder outside holding a victim file; the launch, the run lock, the worker's config write and
the shard writer refuse it in one line, exit 2, before anything is written, and the victim is untouched.
In process: the refusal comes before any rank is spawned."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO
from torchlaunch import config as config_mod
from torchlaunch import rundir, runlock
from torchlaunch.agent import node
from torchlaunch.data.shards.cli import main as shards_main
from torchlaunch.exit_codes import BAD_INPUT, BadInput

SMOKE = str(REPO / "configs" / "smoke.yaml")
RUN_DIR_LINKS = (rundir.LOCK_NODES, rundir.JOB, rundir.LOGS, rundir.PROGRESS, rundir.STATUS, rundir.CHECKPOINTS)
"""The folders the round wrote or deleted through (checkpoints/ held before: the same check now)."""


def victim_folder(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A folder outside every run dir with files a write, append or delete through a link would touch:
    names the run dir's writers use (a slot record, a rank log, a job record, a heartbeat)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    files = {
        "victim.txt": b"not yours\n",
        "node-0.json": b'{"host": "elsewhere", "pid": 1}\n',
        "node-0.json.log": b"keep\n",
        "rank-0.log": b"someone's log\n",
        "rank-0.json": b"{}\n",
    }
    for name, data in files.items():
        (outside / name).write_bytes(data)
    return outside, files


def untouched(outside: Path, files: dict[str, bytes]) -> None:
    assert sorted(p.name for p in outside.iterdir()) == sorted(files), "a file appeared or went"
    for name, data in files.items():
        assert (outside / name).read_bytes() == data, name


def linked_run_dir(tmp_path: Path, name: str) -> tuple[Path, Path, dict[str, bytes]]:
    outside, files = victim_folder(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside, target_is_directory=True)
    return run_dir, outside, files


@pytest.mark.parametrize("name", RUN_DIR_LINKS)
def test_a_launch_refuses_a_linked_run_dir_folder_before_writing(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, outside, files = linked_run_dir(tmp_path, name)
    code = node.main(["--config", SMOKE, f"run_dir={run_dir}", "--device", "cpu"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == BAD_INPUT and len(lines) == 1, err
    assert lines[0].startswith("launch error: ") and "is a symlink to" in lines[0] and name in lines[0], err
    assert sorted(p.name for p in run_dir.iterdir()) == [name], "written before the refusal"
    untouched(outside, files)


def test_an_elastic_members_slot_sweep_never_deletes_through_a_linked_lock_nodes(tmp_path: Path) -> None:
    """The slot sweep unlinks a dead member's node-K.json: through a link it deleted node-0.json outside."""
    run_dir, outside, files = linked_run_dir(tmp_path, rundir.LOCK_NODES)
    with pytest.raises(BadInput, match=r"\.lock\.nodes' is a symlink to"):
        runlock.RunLock(run_dir, job="elastic:tl-x@127.0.0.1:29500").acquire()
    assert not (run_dir / rundir.LOCK).exists()
    untouched(outside, files)


def test_a_lock_guard_linked_out_is_not_created_through(tmp_path: Path) -> None:
    """RUN_DIR/.lock.guard is opened O_CREAT: a dangling link there created a file at its target."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = tmp_path / "outside-guard"
    (run_dir / rundir.LOCK_GUARD).symlink_to(target)
    with pytest.raises(BadInput, match=r"\.lock\.guard: Too many levels of symbolic links"):
        runlock.acquire(run_dir, job="elastic:tl-x@127.0.0.1:29500")  # a join: the guard is taken first
    assert not target.exists()


def test_a_worker_without_a_launcher_refuses_a_linked_logs_folder(tmp_path: Path) -> None:
    run_dir, outside, files = linked_run_dir(tmp_path, rundir.LOGS)
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}"])
    with pytest.raises(BadInput, match=r"^config error: run_dir: .*logs' is a symlink to") as info:
        config_mod.write_resolved(cfg)
    assert "\n" not in str(info.value)
    assert not (run_dir / rundir.CONFIG).exists()
    untouched(outside, files)


def test_a_file_or_a_dangling_link_where_a_folder_goes_is_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundir.PROGRESS).write_text("x")
    with pytest.raises(BadInput, match="progress' is not a folder"):
        rundir.check_folders(run_dir)
    (run_dir / rundir.PROGRESS).unlink()
    (run_dir / rundir.JOB).symlink_to(tmp_path / "nowhere\nsecond line")
    with pytest.raises(BadInput, match="which does not exist") as info:
        rundir.check_folders(run_dir)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ the shard writer's output


def class_folders(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for j in range(3):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, format="PNG")
            (root / cls / f"{j}.png").write_bytes(buf.getvalue())
    return root


def test_the_shard_writer_never_writes_or_deletes_through_a_linked_split_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished write, then out/train swapped for a link to another set holding a foreign shard and a
    file: the rerun overwrote the shard and deleted the file there; now one line, exit 2."""
    src = class_folders(tmp_path / "src")
    out = tmp_path / "out"
    assert shards_main(["write", "--from", str(src), "--out", str(out), "--workers", "1"]) == 0
    outside, files = victim_folder(tmp_path)
    foreign = b"a foreign shard" * 100
    (outside / "train-000000.tar").write_bytes(foreign)
    (outside / "train-000007.tar").write_bytes(foreign)  # a stale name to the old code: deleted
    files = {**files, "train-000000.tar": foreign, "train-000007.tar": foreign}
    os.rename(out / "train", tmp_path / "moved")
    (out / "train").symlink_to(outside, target_is_directory=True)
    plan = (out / ".write-plan.json").read_bytes()
    capsys.readouterr()
    code = shards_main(["write", "--from", str(src), "--out", str(out), "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == BAD_INPUT and len(err) == 1 and err[0].startswith("shards error: "), err
    assert "train' is a symlink to" in err[0]
    assert (out / ".write-plan.json").read_bytes() == plan
    untouched(outside, files)
