"""test_shards_writer: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_shards.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from pathlib import Path

import pytest

from tests.conftest import error_lines, run_module
from tests.unit.test_shards import cifar_subset, files_of, jpeg, mixed, source_samples, written  # noqa: F401 (fixtures, used by name)
from torchlaunch.data.shards import ShardSet
from torchlaunch.data.shards.cli import main as shards_main
from torchlaunch.data.shards.index import INDEX_SUFFIX
from torchlaunch.data.shards.writer import write

pytestmark = pytest.mark.timeout(120)


def test_deterministic_and_interrupted_writer_resumes_to_the_same_bytes(
    mixed: Path, written: Path, tmp_path: Path
) -> None:
    """Same input, same bytes; a writer stopped inside its third shard leaves no index for it, and the
    rerun finishes with exactly the bytes of the uninterrupted write (no temp files left)."""
    again = tmp_path / "again"
    write(mixed, again, val_fraction=0.2, shard_size_mb=0.15, workers=2)  # parallel shards, same bytes as serial
    assert files_of(again) == files_of(written)

    cut = tmp_path / "cut"
    shards_done: list[str] = []

    def hook(event: str, name: str) -> None:
        if event == "shard":
            shards_done.append(name)
        elif len(shards_done) == 2 and name.endswith(".cls"):
            raise KeyboardInterrupt  # a Ctrl-C mid-shard

    with pytest.raises(KeyboardInterrupt):
        write(mixed, cut, val_fraction=0.2, shard_size_mb=0.15, hook=hook)
    third = cut / "train" / "train-000002.tar"
    assert not third.exists() and not Path(str(third) + INDEX_SUFFIX).exists()
    assert list((cut / "train").glob(".train-000002.tar.*.tmp")), "the half shard stayed a temp file"
    assert (cut / "train" / ("train-000001.tar" + INDEX_SUFFIX)).is_file()
    resumed: list[str] = []
    write(
        mixed, cut, val_fraction=0.2, shard_size_mb=0.15, hook=lambda e, n: resumed.append(n) if e == "shard" else None
    )
    assert "train-000000.tar" not in resumed and "train-000002.tar" in resumed
    assert files_of(cut) == files_of(written)


def test_cifar_round_trip_and_resize(cifar_subset: Path, tmp_path: Path) -> None:
    """300 shared CIFAR-10 JPEGs: every byte and label back; with --max-side below 32 every image is
    re-encoded with its long side at 16."""
    out = tmp_path / "cifar"
    assert shards_main(["write", "--from", str(cifar_subset), "--out", str(out), "--shard-size-mb", "0.1"]) == 0
    splits = [ShardSet.open(out), ShardSet.open(out / "val")]  # 2% held out by default (issue 51 item 6)
    assert [len(ss) for ss in splits] == [294, 6] and all(len(ss.classes) == 10 for ss in splits)
    got = sorted((ss.read(i), ss.classes[int(ss.labels[i])]) for ss in splits for i in range(len(ss)))
    assert got == source_samples(cifar_subset)
    small = tmp_path / "small"
    write(cifar_subset, small, max_side=16, quality=80, shard_size_mb=1)
    s2 = ShardSet.open(small / "train")
    assert (s2.sizes == 16).all() and len(s2) == 300


def test_cli_refusals_are_one_line_exit_2(tmp_path: Path, mixed: Path) -> None:
    rc, _out, err = run_module("train.shards", ["write", "--out", str(tmp_path / "o")], timeout=60)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and "the following arguments are required: --from" in lines[0], err
    for argv, words in [
        (
            ["write", "--from", str(mixed), "--out", str(tmp_path / "o"), "--val-fraction", "1.5"],
            "--val-fraction must be between 0 and 1",
        ),
        (
            [
                "write",
                "--from",
                str(mixed),
                "--out",
                str(tmp_path / "o"),
                "--val-fraction",
                "0.1",
                "--val-from",
                str(mixed),
            ],
            "not allowed with",
        ),
        (["write", "--from", str(mixed), "--out", str(tmp_path / "o"), "--quality", "0"], "--quality must be 1-100"),
        (["write", "--from", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist"),
        (
            ["write", "--from", str(mixed), "--out", str(mixed.parent)],
            "is not empty and was not written by this command",
        ),
        (["frobnicate"], "invalid choice"),
        (["verify", str(tmp_path)], "holds no .tar shards"),
    ]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = shards_main(argv)
        lines = error_lines(err.getvalue())
        assert rc == 2 and len(lines) == 1 and words in lines[0], (argv, lines)


def test_reads_after_fork_and_pickle_use_their_own_descriptors(written: Path) -> None:
    """A DataLoader worker forked after the parent read (or a spawned one, which gets a pickled copy)
    opens its own descriptors and reads the same bytes."""
    ss = ShardSet.open(written)
    expect = [ss.read(i) for i in range(len(ss))]
    parent_fds = dict(ss._fds)
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether every read matched through fresh descriptors
        ok = all(ss.read(i) == expect[i] for i in range(len(ss))) and ss._pid == os.getpid()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ss.read(0) == expect[0] and ss._fds == parent_fds  # the parent's cache is untouched
    copy = pickle.loads(pickle.dumps(ss))
    assert not copy._fds and [copy.read(i) for i in range(len(copy))] == expect
