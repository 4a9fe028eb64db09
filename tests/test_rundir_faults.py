"""The run dir as untrusted storage (issue 28, causes 1, 2, 6, 7): OS faults end in one line and exit
2, odd files (FIFOs, symlinks, huge logs) are never waited on or followed, `cancel` acts only on
what this run's launcher proved it started, and a full disk at a save is not a retry loop.

Real files, real tmpfs and bind mounts (as root; skipped with the reason otherwise), the real
launcher for the launch-level cases (a trivial program: no training)."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, launcher
from torchlaunch import rundir, status
from torchlaunch.backends.slurm import proof as slurm_proof
from torchlaunch.base import files, storage
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.checkpoint import store
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import cli, proof, ranklog, record
from torchlaunch.jobs import launcher as oplauncher
from torchlaunch.worker import folder_cache

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


def test_storage_words_every_errno_with_its_fix(tmp_path: Path) -> None:
    for code in storage.STORAGE_ERRNOS:
        line = storage.describe(OSError(code, os.strerror(code), str(tmp_path / "x")))
        assert line.startswith(f"run dir {tmp_path / 'x'}: {os.strerror(code)}") and line.endswith(")")
    assert not storage.is_storage(OSError(errno.ECONNRESET, "reset"))


def test_a_run_dir_starting_with_a_dash_is_not_read_as_an_option() -> None:
    from torchlaunch.backends.local import launch as local

    assert local.not_an_option("-run/config.yaml") == "./-run/config.yaml"
    assert local.not_an_option("/abs/-run/config.yaml") == "/abs/-run/config.yaml"


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


def test_a_log_symlinked_elsewhere_is_not_printed_and_the_tee_does_not_write_through_it(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root:$6$hash\n")
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "rank-0.log").symlink_to(secret)
    out = io.StringIO()
    assert cli.main(["logs", str(tmp_path / "run")], out=out) == 0
    assert "hash" not in out.getvalue()
    fd = ranklog.open_log(str(logs / "rank-0.log"))  # the tee's open: the link is replaced, not followed
    os.write(fd, b"line\n")
    os.close(fd)
    assert secret.read_text() == "root:$6$hash\n" and not (logs / "rank-0.log").is_symlink()
    os.unlink(logs / "rank-0.log")
    os.mkfifo(logs / "rank-0.log")
    fd = ranklog.open_log(str(logs / "rank-0.log"))  # a FIFO without a reader would block the open
    os.close(fd)
    assert (logs / "rank-0.log").is_file()


def test_a_2_gb_log_is_read_from_its_tail(tmp_path: Path) -> None:
    log = tmp_path / "run" / "logs" / "rank-0.log"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GB that take no disk
        f.seek(0, os.SEEK_END)
        f.write(b"\n2026-12-01T00:00:00.000Z last line\n")
    lines, offset = ranklog.read_lines(log, 0)
    assert [t for *_, t in lines][-1] == b"last line" and offset == log.stat().st_size
    data, start = files.read_range(log, -100, 100)
    assert len(data) == 100 and start == log.stat().st_size - 100


def test_an_image_folder_with_a_fifo_or_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    for odd in ("fifo", "loop"):
        root = tmp_path / odd
        (root / "cat").mkdir(parents=True)
        (root / "cat" / "a.jpg").write_bytes(b"x")
        if odd == "fifo":
            os.mkfifo(root / "cat" / "b.jpg")
        else:
            (root / "cat" / "b.jpg").symlink_to(root / "cat" / "c.jpg")
            (root / "cat" / "c.jpg").symlink_to(root / "cat" / "b.jpg")
        with pytest.raises(BadInput, match=r"b\.jpg is not an image file"):
            folder_cache.scan_imagefolder(root)


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


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_forged_slurm_job_id_of_another_job_is_not_scancelled(tmp_path: Path, capsys) -> None:
    from tests.test_slurm_ops_cluster import cluster  # noqa: F401 - the fixture's skip rule

    dev = REPO / "slurm" / "dev-cluster.sh"
    if subprocess.run(["bash", str(dev), "status"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("the Slurm dev cluster is not up (slurm/dev-cluster.sh up)")
    env_out = subprocess.run(["bash", str(dev), "env"], capture_output=True, text=True, timeout=60).stdout
    os.environ["SLURM_CONF"] = env_out.split("SLURM_CONF=", 1)[1].split()[0]
    other = tmp_path / "other"
    other.mkdir()
    sub = subprocess.run(
        ["sbatch", "--parsable", "-o", f"{other}/out-%j.txt", "--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = sub.stdout.strip().split(";")[0]
    try:
        run = tmp_path / "run"
        forged = record.JobRecord(launch_id="S9", scheduler="slurm", job_id=job, host="node1", started=time.time())
        rundir.write_json(record.record_path(run), forged.to_json())
        capsys.readouterr()
        assert cli.main(["cancel", str(run)], out=io.StringIO()) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"Slurm job {job} is not proven this run's" in err[0]
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
        assert state.stdout.strip() in ("PENDING", "RUNNING", "CONFIGURING")
        assert slurm_proof.slurm_job(job, other) is None  # the job's own run dir is proven
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


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
