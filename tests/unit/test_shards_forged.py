"""Issue 38, third hostile round: forged or odd shard data, the index that laundered corruption, one
line per error, and the writer's OS faults. Every case is exit 2 and one quoted, bounded line, in the
CLI, the reader, the launcher's pre-check and the doctor. Tiny tars built with tarfile in tmp_path;
the CLI's main() runs in-process; OS faults are injected at the call that meets them."""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from PIL import Image

from tests.conftest import error_lines
from torchlaunch import config as config_mod
from torchlaunch.data.formats.shards import check_shards
from torchlaunch.data.shards import ShardError, ShardSet
from torchlaunch.data.shards import index as shard_index
from torchlaunch.data.shards.bounds import MAX_CLASSES
from torchlaunch.data.shards.cli import main as shards_main
from torchlaunch.data.shards.index import ALIGN, INDEX_SUFFIX, MAGIC, PREAMBLE, SET_INDEX, load, pack
from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import precheck
from torchlaunch.tools.machine_facts import plugin_facts

pytestmark = pytest.mark.timeout(120)


def jpeg(seed: int, w: int = 12, h: int = 10) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A shard as another tool may write it (GNU format: any member name, newlines and all)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def good_set(root: Path) -> Path:
    """root/train and root/val, one shard each of 4 samples in 2 classes, indexed."""
    for split in ("train", "val"):
        members = []
        for j in range(4):
            members += [(f"s{j}.jpg", jpeg(j)), (f"s{j}.cls", str(j % 2).encode())]
        tar(root / split / f"{split}-000000.tar", members)
    assert shards_main(["index", str(root)]) == 0
    return root


def cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = shards_main(argv)
    return rc, error_lines(capsys.readouterr().err)


def refused(argv: list[str], capsys: pytest.CaptureFixture, words: str) -> str:
    """The command is exit 2 with exactly one line holding `words`; returns that line."""
    rc, lines = cli(argv, capsys)
    assert rc == 2 and len(lines) == 1 and words in lines[0], (argv, rc, lines)
    return lines[0]


# ------------------------------------------------------------------ item 1: forged tar members


@pytest.mark.parametrize(
    "members, words",
    [
        ([(b"k\xff\xfe.jpg".decode("utf-8", "surrogateescape"), jpeg(0)), ("k.cls", b"1")], "not UTF-8 text"),
        ([("k.jpg", jpeg(0)), ("k.cls", b"99999999999999999999")], "above the limit"),  # above int64
        ([("k.jpg", jpeg(0)), ("k.cls", b"9000000000000000000")], "above the limit"),  # 9e18 class names
        ([("k.jpg", jpeg(0)), ("k.cls", str(MAX_CLASSES).encode())], "above the limit"),
    ],
    ids=["non-utf8-key", "cls-above-int64", "cls-9e18", "cls-one-past-limit"],
)
def test_forged_members_are_refused_at_index_time(
    tmp_path: Path, capsys: pytest.CaptureFixture, members: list, words: str
) -> None:
    """Old code: UnicodeEncodeError / OverflowError tracebacks, and a 9e18 label indexed fine and then
    built 9e18 class names (MemoryError) when the set was opened. Nothing is written on refusal."""
    tar(tmp_path / "train" / "a.tar", members)
    line = refused(["index", str(tmp_path)], capsys, words)
    assert line.startswith("data error: a.tar member ")
    assert not list((tmp_path / "train").glob("*" + INDEX_SUFFIX)) and not (tmp_path / "train" / SET_INDEX).exists()


def test_largest_class_index_is_accepted(tmp_path: Path) -> None:
    tar(tmp_path / "a.tar", [("k.jpg", jpeg(0)), ("k.cls", str(MAX_CLASSES - 1).encode())])
    assert shards_main(["index", str(tmp_path)]) == 0
    assert len(ShardSet.open(tmp_path).classes) == MAX_CLASSES


# ------------------------------------------------------------------ item 1: forged index files


def forge_columns(idx: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    """Rewrite an index with edited columns and valid checksums (what a forger does: xxh3 is no MAC)."""
    old = load(idx, "shard")
    columns = {k: np.array(v) for k, v in old.columns.items()} | {"key": np.array(old.keys())}
    edit(columns)
    idx.write_bytes(b"".join(pack("shard", old.shards, columns)))


def forge_header(idx: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite an index's JSON header (checksum recomputed, columns moved to the new data start)."""
    raw = idx.read_bytes()
    _magic, version, hlen, _sum = PREAMBLE.unpack_from(raw)
    data = raw[-(-(PREAMBLE.size + hlen) // ALIGN) * ALIGN :]
    header = json.loads(raw[PREAMBLE.size : PREAMBLE.size + hlen])
    edit(header)
    new = json.dumps(header).encode()
    pad = -(-(PREAMBLE.size + len(new)) // ALIGN) * ALIGN - PREAMBLE.size - len(new)
    idx.write_bytes(PREAMBLE.pack(MAGIC, version, len(new), xxhash.xxh3_64(new).intdigest()) + new + b"\0" * pad + data)


def _set(name: str, value) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(columns: dict[str, np.ndarray]) -> None:
        columns[name][1] = value

    return edit


def _column_meta(name: str, **changes) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header["columns"][name].update(changes)

    return edit


FORGED_COLUMNS = {
    "label-negative": (_set("label", -5), "has class -5"),
    "label-9e18": (_set("label", 9 * 10**18), "outside 0..1048575"),
    "size-zero": (_set("size", [0, 10]), "image size of 0x10"),
    "size-negative": (_set("size", [-12, 10]), "image size of -12x10"),
    "ext-out-of-range": (_set("ext", 9), "unknown image type code 9"),
    "offset-past-shard": (_set("offset", 2**63 + 5), "lies past the end of its shard"),
}
FORGED_HEADERS = {
    "shape-negative": (_column_meta("label", shape=[-4]), "impossible shape"),
    "shape-overflow": (_column_meta("offset", shape=[2**62, 2**62]), "ends past the file"),
    "shape-3d": (_column_meta("label", shape=[1, 1, 4]), "impossible shape"),
    "dtype-object-key": (_column_meta("key", dtype="|O"), "expected bytes"),
    "dtype-object-label": (_column_meta("label", dtype="|O"), "expected <i8"),
    "dtype-not-a-string": (_column_meta("key", dtype=[["a", "<i4"]]), "has a damaged header"),
    "at-negative": (_column_meta("label", at=-4096), "impossible shape"),
    "shard-count-negative": (lambda h: h["shards"][0].update(count=-4), "impossible size or sample count"),
}


@pytest.mark.parametrize("case", sorted(FORGED_COLUMNS) + sorted(FORGED_HEADERS))
def test_forged_index_is_one_line_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    """A forged train index (valid checksums, values out of range) is refused by verify, the reader, the
    launcher's pre-check and the doctor, one line each. Old code: verify passed a label of -5, sizes
    of 0 or below (training then died in a loader worker with ZeroDivisionError, or trained on
    nonsense) and an unreadable key column; 9e18 built 9e18 class names; an extension code, offset,
    negative shape or column offset out of range were tracebacks, exit 1. The 3-d shape, 2^62 shape
    and negative shard count were one line there too (other words): kept as guards on the message."""
    root = good_set(tmp_path / "set")
    idx = root / "train" / ("train-000000.tar" + INDEX_SUFFIX)
    (root / "train" / SET_INDEX).unlink()  # the reader falls back to the per-shard index: forge that one
    if case in FORGED_COLUMNS:
        forge_columns(idx, FORGED_COLUMNS[case][0])
    else:
        forge_header(idx, FORGED_HEADERS[case][0])
    words = {**FORGED_COLUMNS, **FORGED_HEADERS}[case][1]
    rc, lines = cli(["verify", str(root)], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("data error: ") and words in lines[0], lines
    if case == "dtype-object-key":  # keys are read only to name a sample in an error line, and only verify reads them
        assert ShardSet.open(root / "train").where(0) == "train-000000.tar member #0.jpg"
        return
    with pytest.raises(ShardError, match=words.replace(".", r"\.")):
        ShardSet.open(root / "train")
    with pytest.raises(BadInput, match=words.replace(".", r"\.")):
        check_shards(root)
    cfg = config_mod.load(None, ["data.name=shards", f"data.root={root}"])
    with pytest.raises(BadInput, match="^data error: "):
        precheck.check(cfg, on_cpu=True, local=True)
    facts = [f for f in plugin_facts(None, ["data.name=shards", f"data.root={root}"]) if f["key"] == "data.root"]
    assert len(facts) == 1 and not facts[0]["ok"] and words in facts[0]["error"], facts


@pytest.mark.parametrize("splits", [[], "train", {"train": ["x"]}], ids=["list", "string", "split-list"])
def test_manifest_with_a_damaged_split_table(tmp_path: Path, capsys: pytest.CaptureFixture, splits) -> None:
    """Old code: AttributeError ('list' object has no attribute 'get'), exit 1."""
    root = good_set(tmp_path / "set")
    manifest = {"format": "torchlaunch-shards", "version": 1, "classes": ["a", "b"], "splits": splits}
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="has a damaged split table"):
        ShardSet.open(root / "train")
    rc, lines = cli(["verify", str(root)], capsys)
    assert rc == 2 and len(lines) == 2 and all("has a damaged split table" in ln for ln in lines), lines  # train, val


# ------------------------------------------------------------------ item 5: one line is one line


def test_a_newline_in_a_member_name_cannot_cut_or_forge_a_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Old code: `data error: a.tar member a` (the line cut at the newline) at index time, and from
    verify a second line written by the shard's data."""
    forged = "a\ndata error: every shard is good, ignore the line above"
    tar(tmp_path / "one" / "a.tar", [(f"{forged}.jpg", b"not an image"), (f"{forged}.cls", b"1")])
    line = refused(["index", str(tmp_path / "one")], capsys, "is not a readable image")
    assert repr(forged)[1:-1] in line
    # indexable (a PNG header PIL reads) but undecodable (its data cut): verify reads the key back from the index
    png = io.BytesIO()
    Image.fromarray(np.zeros((40, 40, 3), np.uint8) + 7).save(png, format="PNG")
    tar(tmp_path / "two" / "a.tar", [(f"{forged}.png", png.getvalue()[:60]), (f"{forged}.cls", b"1")])
    assert shards_main(["index", str(tmp_path / "two")]) == 0
    line = refused(["verify", str(tmp_path / "two")], capsys, "cannot be decoded")
    assert line.startswith("data error: a.tar member 'a\\ndata error: every shard is good"), line


def test_shard_error_is_one_bounded_line() -> None:
    err = ShardError("shard x\nforged" + "y" * 5000, "fix\r\nit")
    assert "\n" not in str(err) and "\r" not in str(err) and len(str(err)) < 2000


# ------------------------------------------------------------------ item 2: the index must not launder corruption


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """Class folders of 6 small JPEGs each."""
    for c, cls in enumerate(("ant", "bee")):
        (tmp_path / "src" / cls).mkdir(parents=True)
        for j in range(6):
            (tmp_path / "src" / cls / f"{j}.jpg").write_bytes(jpeg(10 * c + j, 40, 30))
    return tmp_path / "src"


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_reindex_of_a_foreign_shard_over_changed_bytes_needs_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = good_set(tmp_path / "set")
    shard = root / "train" / "train-000000.tar"
    flip(shard, int(ShardSet.open(root / "train")._offset[1]) + 50)
    line = refused(["index", str(root)], capsys, "differs from its index")
    assert "restore a good copy" in line and "--accept-changed" in line
    assert shards_main(["index", "--accept-changed", str(root)]) == 0


# ------------------------------------------------------------------ item 6: the writer's OS faults


def test_writer_argument_and_folder_refusals(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Old code: ValueError (negative seed) and FileExistsError tracebacks; --out inside --from was
    written, and became a class of the source on the next run."""
    write = ["write", "--from", str(source), "--out"]
    refused([*write, str(tmp_path / "o"), "--split-seed", "-1"], capsys, "--split-seed must be 0-")
    (tmp_path / "afile").write_text("x")
    refused([*write, str(tmp_path / "afile")], capsys, "a file stands where a folder must be")
    if Path("/proc/self").is_dir():  # no folder can be made there, whoever runs this (ENOENT as root)
        refused([*write, "/proc/torchlaunch-shards"], capsys, "shards error: --out /proc/torchlaunch-shards: ")
    refused([*write, str(source / "shards")], capsys, "is inside --from")
    assert not (source / "shards").exists()
    refused([*write, str(source)], capsys, "is --from")
    refused([*write, str(tmp_path / "v" / "out"), "--val-from", str(tmp_path / "v")], capsys, "is inside --val-from")


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.EACCES, "Permission denied (you may not write there"),
        (errno.EROFS, "Read-only file system (the filesystem is mounted read-only"),
    ],
)
def test_unwritable_out_is_one_line(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    """The first write into --out (its plan) meets the OS error, as on a root-owned or read-only mount
    (tests may run as root, where chmod would not refuse)."""
    from torchlaunch.data.shards import writer

    def refuse(path, *a, **k):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(writer, "write_json", refuse)
    line = refused(["write", "--from", str(source), "--out", str(tmp_path / "o")], capsys, words)
    assert line.startswith("shards error: --out ")


def test_a_full_disk_mid_shard_is_one_line_and_leaves_no_finished_looking_set(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC inside the second shard: one line with the free space, the partial shard's temp file
    removed, no manifest, and the reader calls the set unfinished; the rerun completes it."""
    out = tmp_path / "set"
    argv = ["write", "--from", str(source), "--out", str(out), "--shard-size-mb", "0.01", "--workers", "1"]
    real = tarfile.TarFile.addfile
    calls = {"n": 0}

    def full(self, tarinfo, fileobj=None):
        calls["n"] += 1
        if calls["n"] == 9:  # past the first shard's members
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.fileobj.name)
        return real(self, tarinfo, fileobj)

    monkeypatch.setattr(tarfile.TarFile, "addfile", full)
    line = refused(argv, capsys, "No space left on device")
    assert line.startswith("shards error: --out ") and " free (free space there" in line
    assert not list(out.rglob("*.tmp")) and not (out / "manifest.json").exists()
    with pytest.raises(ShardError, match="did not finish"):
        ShardSet.open(out)
    monkeypatch.setattr(tarfile.TarFile, "addfile", real)
    assert shards_main(argv) == 0 and len(ShardSet.open(out)) + len(ShardSet.open(out / "val")) == 12


def test_index_on_a_read_only_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    tar(tmp_path / "a.tar", [("k.jpg", jpeg(0)), ("k.cls", b"0")])

    def read_only(path, parts):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(shard_index, "write_durable", read_only)
    line = refused(["index", str(tmp_path)], capsys, "Read-only file system")
    assert line.startswith("shards error: shard folder ")
