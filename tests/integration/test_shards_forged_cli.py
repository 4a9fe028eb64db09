"""test_shards_forged_cli: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_shards_forged.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.unit.test_shards_forged import (
    cli,
    flip,
    refused,
    source,  # noqa: F401 (fixtures, used by name)
)
from torchlaunch.data.shards import ShardSet
from torchlaunch.data.shards.cli import main as shards_main
from torchlaunch.data.shards.index import INDEX_SUFFIX, SET_INDEX
from torchlaunch.data.shards.record import SUMS

pytestmark = pytest.mark.timeout(120)


def test_reindex_does_not_bless_a_flipped_byte(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Old code: verify advised `index DIR`, and after it verify said every shard and member was good.
    Now `index` refuses (nothing written), `--accept-changed` indexes the bytes but verify still names
    the shard against the writer's record, and the command verify gives rewrites it byte for byte."""
    out = tmp_path / "set"
    assert shards_main(["write", "--from", str(source), "--out", str(out), "--val-fraction", "0.25"]) == 0
    shard = out / "train" / "train-000000.tar"
    good = shard.read_bytes()
    flip(shard, int(ShardSet.open(out / "train")._offset[2]) + 100)

    rc, lines = cli(["verify", str(out)], capsys)
    assert rc == 2 and len(lines) == 2 and "does not match its index checksum" in lines[0], lines
    assert "is corrupt (checksum mismatch)" in lines[1] and "re-indexing does not repair it" in lines[1], lines
    line = lines[0]
    assert "train.shards index" not in line, line
    command = line.split("(only shards that differ are rewritten): ", 1)[1].rstrip(")")
    idx = out / "train" / ("train-000000.tar" + INDEX_SUFFIX)
    before = (idx.read_bytes(), (out / "train" / SET_INDEX).read_bytes())
    refused(["index", str(out)], capsys, "differs from what the writer recorded")
    assert (idx.read_bytes(), (out / "train" / SET_INDEX).read_bytes()) == before, "the refusal wrote nothing"

    assert shards_main(["index", "--accept-changed", str(out)]) == 0
    rc, lines = cli(["verify", str(out)], capsys)
    assert rc == 2 and len(lines) == 1 and "differs from what the writer recorded" in lines[0], lines

    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "train.shards", "write"]
    assert shards_main(argv[3:]) == 0
    assert shard.read_bytes() == good
    assert cli(["verify", str(out)], capsys)[0] == 0


def test_a_damaged_writer_record_is_refused(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "set"
    assert shards_main(["write", "--from", str(source), "--out", str(out), "--val-fraction", "0.25"]) == 0
    (out / "train" / SUMS).write_text("0123 12 train-000000.tar\nnot a line\n")
    refused(["verify", str(out)], capsys, "is damaged (line 2)")
