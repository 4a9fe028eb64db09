"""The run dir as untrusted storage (issue 28, causes 1, 2, 6, 7): OS faults end in one line and exit
2, odd files (FIFOs, symlinks, huge logs) are never waited on or followed, `cancel` acts only on
what this run's launcher proved it started, and a full disk at a save is not a retry loop.

Real files, real tmpfs and bind mounts (as root; skipped with the reason otherwise), the real
launcher for the launch-level cases (a trivial program: no training)."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.live import pid_of, traced_step
from tests.conftest import launcher_argv
from tests.helpers import REPO, launcher
from tests.integration.test_live_commit import recipe, shard_set  # noqa: F401 - shard_set: a fixture
from torchlaunch import rundir, status
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.checkpoint import store
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import cli, proof, ranklog, record
from torchlaunch.jobs import launcher as oplauncher

PROGRAM = str(REPO / "tests" / "programs" / "exit_with.py")
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="mounting tmpfs and bind mounts needs root")


def mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[callable]:
    """mount_tmpfs(name, size, ro=False) -> its path; every mount is undone in teardown."""
    mounted: list[Path] = []

    def make(name: str, size: str = "1m", ro: bool = False) -> Path:
        where = tmp_path / name
        where.mkdir()
        mount("-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs", str(where))
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def one_line_exit_2(done: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---- cause 1: OS errors at the launcher -------------------------------------------------------


@needs_root
def test_a_full_disk_at_launch_is_one_line(tmpfs, tmp_path: Path) -> None:
    full = tmpfs("full", "200k")
    with open(full / "fill", "wb") as f:  # fill it to the last block
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    done = launcher(["--run-dir", str(full / "run"), "--", PROGRAM, "0", str(tmp_path / "o")], timeout=120)
    one_line_exit_2(done, str(full / "run"), "No space left on device", "free")


@needs_root
def test_a_read_only_run_dir_at_start_is_one_line(tmpfs, tmp_path: Path) -> None:
    ro = tmpfs("ro", ro=True)
    done = launcher(["--run-dir", str(ro / "run"), "--", PROGRAM, "0", str(tmp_path / "o")], timeout=120)
    one_line_exit_2(done, "Read-only file system", "remount it read-write")


def test_a_name_too_long_and_a_file_in_the_path_are_one_line(tmp_path: Path) -> None:
    long = tmp_path / ("a" * 300)
    done = launcher(["--run-dir", str(long), "--", PROGRAM, "0", str(tmp_path / "o")], timeout=120)
    one_line_exit_2(done, "File name too long", "shorter name")
    (tmp_path / "afile").write_text("")
    done = launcher(["--run-dir", str(tmp_path / "afile" / "run"), "--", PROGRAM, "0", str(tmp_path / "o")])
    one_line_exit_2(done, "Not a directory", "a file stands where a folder must be")


@needs_root
def test_the_run_dir_going_read_only_mid_run_still_ends_in_one_line(tmpfs, capsys) -> None:
    run = tmpfs("midrun")
    op = oplauncher.Operation(run, scheduler="local", command=["x"], launch_id="L1")
    op.start()
    mount("-o", "remount,ro", str(run))
    assert op.finish(75) == 75  # the workers' code survives: the checkpoint is what counts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "outcome preempted (exit 75) not recorded" in err[0] and "Read-only" in err[0]


@needs_root
def test_quarantine_on_another_filesystem_or_a_file_falls_back_to_a_rename_in_place(tmpfs, tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    for n, setup in enumerate(("file", "mount")):
        root.mkdir(exist_ok=True)
        bad = ckpt.write_checkpoint(root, n + 1, {"format_version": 1, "w": torch.zeros(4)}, {}).path
        if setup == "file":
            (root / store.QUARANTINE_DIR).write_text("not a folder")
        else:
            (root / store.QUARANTINE_DIR).unlink()
            (root / store.QUARANTINE_DIR).mkdir()
            mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root / store.QUARANTINE_DIR))
        try:
            moved = store.quarantine(root, bad)
            assert moved.parent == root and moved.name.startswith("quarantine-step-") and (moved / "state.pt").exists()
            assert not bad.exists() and all(p.name != bad.name for _, p in ckpt.candidates(root))
        finally:
            if setup == "mount":
                subprocess.run(["umount", str(root / store.QUARANTINE_DIR)], capture_output=True, timeout=30)


# ---- cause 2: what a file is -----------------------------------------------------------------


def test_fifos_under_run_dir_names_are_refused_never_waited_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "job").mkdir(parents=True)
    (run / "status").mkdir()
    (run / "logs").mkdir()
    for fifo in ("job/cancel.json", "job/node-0.json", "status/A1-rank0.json", "logs/rank-0.log", ".lock.json"):
        os.mkfifo(run / fifo)
    assert record.cancel_request(run) == (None, None)
    recs, problems = record.read_all(run)
    assert recs == [] and problems == []  # not a regular file: not a record
    assert status.records(run / "status", "A1") == []
    assert ranklog.read_lines(run / "logs" / "rank-0.log", 0) == ([], None)
    out = io.StringIO()
    assert cli.main(["logs", str(run)], out=out) == 0 and out.getvalue() == ""
    assert cli.main(["status", str(run), "--no-scheduler"], out=io.StringIO()) == 0
    assert cli.main(["list", str(tmp_path), "--no-scheduler"], out=io.StringIO()) == 0
    done = launcher(["--run-dir", str(run), "--", PROGRAM, "0", str(tmp_path / "o")], timeout=120)
    one_line_exit_2(done, "in use by a holder whose record cannot be read", str(run / ".lock.json"))
    from torchlaunch.worker.metrics import MetricsLog

    os.mkfifo(run / "metrics.jsonl")  # the worker's own append: replaced, not blocked on
    metrics = MetricsLog(run / "metrics.jsonl", True, None)
    metrics.write({"step": 1})
    metrics.close()
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


# ---- cause 6: cancel acts on proof, not on the record ------------------------------------------


def test_a_forged_record_naming_an_unrelated_process_is_refused(tmp_path: Path, capsys) -> None:
    from torchlaunch.base import procs

    victim = subprocess.Popen(["sleep", "300"])
    try:
        forged = record.JobRecord(
            launch_id="F1",
            host=os.uname().nodename,
            launcher_pid=victim.pid,
            launcher_start=procs.start_ticks(victim.pid),
            started=time.time(),
            extra={proof.DIGEST_KEY: proof.digest("guessed")},
        )
        rundir.write_json(record.record_path(tmp_path), forged.to_json())
        assert cli.main(["cancel", str(tmp_path)], out=io.StringIO()) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cancel refused" in err[0] and f"pid {victim.pid}" in err[0]
        assert victim.poll() is None and not record.cancel_requested(tmp_path, "F1")
    finally:
        victim.kill()
        victim.wait(timeout=30)


# ---- cause 7: a full disk at a save ------------------------------------------------------------


@needs_root
def test_a_save_onto_a_full_disk_is_a_storage_refusal_not_a_retry(tmpfs) -> None:
    small = tmpfs("small", "600k")
    ckpt.write_checkpoint(small, 1, {"format_version": 1, "w": torch.ones(64, 1024)}, {})  # 256 KiB
    with pytest.raises(store.CheckpointStorageError) as err:
        ckpt.write_checkpoint(small, 2, {"format_version": 1, "w": torch.ones(256, 1024)}, {})  # 1 MiB
    message = str(err.value)
    assert isinstance(err.value, BadInput)  # the runner's exit 2: schedulers never retry it
    assert str(small / "step-000000002") in message and " free" in message and "step-000000001 is intact" in message
    again = store.checkpoint_error(message)  # how every other rank raises rank 0's failure
    assert isinstance(again, store.CheckpointStorageError)
    assert not isinstance(store.checkpoint_error("checkpoint error: injected"), BadInput)
    assert ckpt.find_latest(small)[0].name == "step-000000001"


def fill(folder: Path) -> None:
    """Write a file in `folder` until its filesystem is full (ENOSPC)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize(
    "lose_rank_0", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["at-a-save", "at-a-regroup"]
)
def test_a_live_run_dir_filling_up_mid_run_is_exit_2_and_one_storage_line(
    tmpfs, shard_set: Path, tmp_path: Path, lose_rank_0: bool
) -> None:
    """Issue #52 item 6: 2 live ranks on shards with loader workers, their run dir on a 16 MB tmpfs
    filled at step 5 (rank 0 SIGKILLed first, at-a-regroup). Was: exit 1 with no storage line (the rank
    log's tee died of ENOSPC, the rank's outcome record could not be written), or 27 'did not form (No
    space left on device): a member is gone'. Now: exit 2, the storage line, the checkpoints before intact."""
    run_dir = tmpfs("small", "16m") / "run"
    run_dir.mkdir()
    config = tmp_path / "live.yaml"
    config.write_text(recipe(run_dir, shard_set))
    argv = launcher_argv("launch.local", "--gpus", "2", "--device", "cpu", "--config", str(config))
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while traced_step(run_dir / "trace" / "rank0.jsonl") < 5:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.005)  # polling a file another process writes: no event to wait on
        if lose_rank_0:
            os.kill(pid_of(run_dir, 0), signal.SIGKILL)
        fill(run_dir.parent)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "a member is gone" not in out, out[-3000:]
    said = [line for line in out.splitlines() if "error: storage" in line or line.startswith("storage error: ")]
    assert said and all("no space left on device" in line.lower() for line in said), out[-3000:]
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept and all(ckpt.verify(run_dir / "checkpoints" / name) is None for name in kept)
