"""Tar shards (torchlaunch.shards): writer, offset index, random-access reader, decoder, verify, and
every bad-shard case as one line + exit 2. Small generated sets and a few hundred shared CIFAR-10
JPEGs; everything on CPU, real files (FIFOs and symlinks included), no mocks."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import error_lines, run_module, shared_tarball
from torchlaunch.exit_codes import BadInput
from torchlaunch.shards import ShardError, ShardSet, decode
from torchlaunch.shards.cli import main as shards_main
from torchlaunch.shards.index import INDEX_SUFFIX, SET_INDEX
from torchlaunch.shards.writer import write

pytestmark = pytest.mark.timeout(120)


def jpeg(arr: np.ndarray, mode: str | None = None, **kw) -> bytes:
    out = io.BytesIO()
    im = Image.fromarray(arr)
    (im.convert(mode) if mode else im).save(out, format="JPEG", **kw)
    return out.getvalue()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Class folders of JPEGs of mixed sizes and aspect ratios, plus grayscale, CMYK, PNG (RGBA and
    palette) and a 16-bit PNG."""
    root = tmp_path_factory.mktemp("mixed") / "src"
    rng = np.random.default_rng(0)
    for c, cls in enumerate(("cat", "dog", "fish")):
        (root / cls).mkdir(parents=True)
        for j in range(14):
            w, h = (int(x) for x in rng.integers(24, 400, 2))
            arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            (root / cls / f"img{j:02d}.jpg").write_bytes(jpeg(arr, quality=85))
        arr = rng.integers(0, 255, (60 + c, 90, 3), dtype=np.uint8)
        (root / cls / "gray.jpg").write_bytes(jpeg(arr, "L"))
        (root / cls / "cmyk.jpg").write_bytes(jpeg(arr, "CMYK"))
        Image.fromarray(arr).convert("RGBA").save(root / cls / "alpha.png")
        Image.fromarray(arr).convert("P").save(root / cls / "palette.png")
        Image.fromarray(arr[..., 0].astype(np.uint16) * 257).save(root / cls / "deep.png")
    return root


@pytest.fixture(scope="module")
def cifar_subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 images per class of the shared CIFAR-10 JPEGs, read from the tarball into class folders."""
    tarball = shared_tarball()
    if not tarball.is_file():
        pytest.skip(f"shared CIFAR-10 copy not found at {tarball} (set TORCHLAUNCH_SHARED_DATA to it)")
    root = tmp_path_factory.mktemp("cifar-subset") / "train"
    counts: dict[str, int] = {}
    with tarfile.open(tarball) as tf:
        for m in tf:
            parts = m.name.split("/")
            if not m.isfile() or len(parts) != 3 or counts.get(parts[1], 0) >= 30:
                continue
            counts[parts[1]] = counts.get(parts[1], 0) + 1
            (root / parts[1]).mkdir(parents=True, exist_ok=True)
            (root / parts[1] / parts[2]).write_bytes(tf.extractfile(m).read())
            if len(counts) == 10 and all(v >= 30 for v in counts.values()):
                break
    return root


def files_of(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def source_samples(root: Path) -> list[tuple[bytes, str]]:
    return sorted((p.read_bytes(), p.parent.name) for p in root.rglob("*") if p.is_file())


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    rc = shards_main(argv)
    return rc, error_lines(capsys.readouterr().err)


@pytest.fixture(scope="module")
def written(mixed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("written") / "set"
    write(mixed, out, val_fraction=0.2, shard_size_mb=0.15)
    return out


def test_round_trip_generated_mixed_modes(mixed: Path, written: Path) -> None:
    """Every source JPEG in L or RGB is stored byte for byte with its label; the other modes (CMYK,
    PNG, 16-bit) decode to RGB of the source's size; train + val hold every source image once."""
    train, val = ShardSet.open(written / "train"), ShardSet.open(written, "val")
    assert train.classes == val.classes == ["cat", "dog", "fish"]
    assert len(train) + len(val) == sum(1 for p in mixed.rglob("*") if p.is_file())
    assert len(train.shards) > 2 and train.labels.dtype == np.int64 and train.sizes.dtype == np.int32
    stored: list[tuple[bytes, str]] = []
    sizes: list[tuple[int, int]] = []
    for ss in (train, val):
        for i in range(len(ss)):
            data = ss.read(i)
            im = decode(data, ss.where(i))
            assert im.mode == "RGB" and im.size == tuple(ss.sizes[i])
            stored.append((data, ss.classes[int(ss.labels[i])]))
            sizes.append(im.size)
    copied = [
        (b, c)
        for b, c in source_samples(mixed)
        if b[:3] == b"\xff\xd8\xff" and Image.open(io.BytesIO(b)).mode in ("L", "RGB")
    ]
    assert len(copied) == 3 * 15
    assert all(s in stored for s in copied)
    first = train.labels[: train.shards[0].count]
    assert len(set(first.tolist())) > 1, "the seeded order mixes classes within a shard"
    assert train.where(0).startswith("train-000000.tar member 00000000_") and train.where(0).endswith(".jpg")


def test_draft_decodes_smaller_and_cmyk_to_rgb(written: Path) -> None:
    ss = ShardSet.open(written / "train")
    big = int(np.argmax(ss.sizes[:, 0] * ss.sizes[:, 1]))
    w, h = (int(x) for x in ss.sizes[big])
    small = decode(ss.read(big), ss.where(big), draft_to=(w // 4, h // 4))
    assert small.size[0] < w and small.size[0] >= w // 4 and small.mode == "RGB"
    with pytest.raises(ShardError, match=r"^data error: X.tar member k.jpg cannot be decoded"):
        decode(b"\xff\xd8\xff garbage", "X.tar member k.jpg")
    err = ShardError("X.tar member k.jpg is corrupt", "replace it")
    assert str(pickle.loads(pickle.dumps(err))) == str(err) == "data error: X.tar member k.jpg is corrupt (replace it)"


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
    ss = ShardSet.open(out)
    assert len(ss) == 300 and len(ss.classes) == 10
    got = sorted((ss.read(i), ss.classes[int(ss.labels[i])]) for i in range(len(ss)))
    assert got == source_samples(cifar_subset)
    small = tmp_path / "small"
    write(cifar_subset, small, max_side=16, quality=80, shard_size_mb=1)
    s2 = ShardSet.open(small / "train")
    assert (s2.sizes == 16).all() and len(s2) == 300


def wds_tar(path: Path, samples: list[tuple[str, bytes, str, int]]) -> None:
    """A shard as other tools write it: tarfile defaults (pax format, mtimes), extra .json members."""
    with tarfile.open(path, "w") as tf:
        for key, data, ext, label in samples:
            for name, payload in (
                (f"{key}.{ext}", data),
                (f"{key}.cls", f"{label}\n".encode()),
                (f"{key}.json", b"{}"),
            ):
                ti = tarfile.TarInfo(name)
                ti.size, ti.mtime = len(payload), 1_700_000_000
                tf.addfile(ti, io.BytesIO(payload))


@pytest.fixture
def foreign(tmp_path: Path) -> tuple[Path, list[bytes]]:
    rng = np.random.default_rng(1)
    folder = tmp_path / "wds" / "train"
    folder.mkdir(parents=True)
    expect: list[bytes] = []
    for s in range(3):
        samples = []
        for j in range(4):
            arr = rng.integers(0, 255, (20 + j, 30, 3), dtype=np.uint8)
            if j == 3:
                buf = io.BytesIO()
                Image.fromarray(arr).save(buf, format="PNG")
                samples.append((f"n0{s}_{j}", buf.getvalue(), "png", (s + j) % 5))
            else:
                samples.append((f"n0{s}_{j}", jpeg(arr), "jpg", (s + j) % 5))
            expect.append(samples[-1][1])
        wds_tar(folder / f"imagenet-train-{s:06d}.tar", samples)
    return folder, expect


def test_index_foreign_webdataset_shards_then_verify(foreign: tuple[Path, list[bytes]], capsys) -> None:
    folder, expect = foreign
    with pytest.raises(ShardError, match="has no index"):
        ShardSet.open(folder)
    (folder.parent / "manifest.json").write_text('{"name": "another tool\'s manifest"}')  # ignored, not refused
    rc, _ = run_cli(["index", str(folder.parent)], capsys)
    assert rc == 0 and (folder / SET_INDEX).is_file()
    ss = ShardSet.open(folder.parent)
    assert [ss.read(i) for i in range(len(ss))] == expect
    assert ss.classes == [str(i) for i in range(5)] and ss.where(3) == "imagenet-train-000000.tar member n00_3.png"
    assert run_cli(["verify", str(folder.parent)], capsys) == (
        0,
        [f"shards: {folder.parent} verified: every shard and member is good"],
    )
    assert run_cli(["index", str(folder.parent)], capsys)[1] == [
        f"shards: 0 shard index(es) built under {folder.parent}"
    ]


def flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def bad_case(folder: Path, case: str) -> str:
    """Damage the set the way `case` says; returns the shard name the error line must name."""
    shard = folder / "imagenet-train-000001.tar"
    idx = Path(str(shard) + INDEX_SUFFIX)
    ss = ShardSet.open(folder)
    member = ss._offset[5]  # sample 5 = the second shard's second sample
    ss.close()
    if case == "truncated":
        os.truncate(shard, shard.stat().st_size - 1500)
    elif case == "corrupt":
        flip_byte(shard, int(member) + 40)
    elif case == "missing":
        shard.unlink()
    elif case == "index-foreign":
        (folder / SET_INDEX).unlink()
        idx.write_bytes(b"PK\x03\x04 not an index at all" * 4)
    elif case == "index-newer":
        (folder / SET_INDEX).unlink()
        flip_byte(idx, 8)  # the version field's low byte: 1 -> 254
    elif case == "index-mismatch":
        (folder / SET_INDEX).unlink()
        wds_tar(shard, [("other", jpeg(np.zeros((8, 8, 3), np.uint8)), "jpg", 0)] * 30)  # another shard's bytes
    elif case == "undecodable":
        data = bytearray(shard.read_bytes())
        dht = data.index(b"\xff\xc4", int(member))  # a bogus Huffman table: the header reads, the image does not
        data[dht + 5 : dht + 21] = b"\xff" * 16
        shard.write_bytes(bytes(data))
        # re-indexed on purpose: checksums agree, the image does not decode
        assert shards_main(["index", "--accept-changed", str(folder)]) == 0
    elif case == "fifo":
        shard.unlink()
        os.mkfifo(shard)
    elif case == "symlink":
        shard.rename(folder.parent / "elsewhere.tar")
        shard.symlink_to(folder.parent / "elsewhere.tar")
    return shard.name


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "corrupt",
        "missing",
        "index-foreign",
        "index-newer",
        "index-mismatch",
        "undecodable",
        "fifo",
        "symlink",
    ],
)
def test_bad_shard_is_one_line_exit_2(foreign: tuple[Path, list[bytes]], case: str, capsys) -> None:
    """verify (and the reader) name the shard (and the member where there is one) in one line, exit 2,
    without hanging on a FIFO or following a symlink."""
    folder, _ = foreign
    assert shards_main(["index", str(folder)]) == 0
    name = bad_case(folder, case)
    capsys.readouterr()
    rc, lines = run_cli(["verify", str(folder)], capsys)
    assert rc == 2 and lines, lines
    assert all(ln.startswith("data error: ") and name in ln for ln in lines), lines
    if case == "corrupt":  # the shard's checksum line, then the member's
        assert len(lines) == 2 and "does not match its index checksum" in lines[0], lines
        assert "member n01_1.jpg is corrupt" in lines[1], lines
    if case == "undecodable":
        assert len(lines) == 1 and "member n01_1.jpg cannot be decoded" in lines[0], lines
    if case == "corrupt":
        ss = ShardSet.open(folder)
        with pytest.raises(ShardError, match="imagenet-train-000001.tar member n01_1.jpg is corrupt"):
            ss.read(5)
    if case in ("truncated", "missing", "fifo", "symlink", "index-foreign", "index-newer", "index-mismatch"):
        with pytest.raises(BadInput) as e:
            ss = ShardSet.open(folder)
            for i in range(len(ss)):
                ss.read(i)
        assert name in str(e.value) and "\n" not in str(e.value)
    if case in ("fifo", "symlink"):
        assert f"is a {'FIFO' if case == 'fifo' else 'symlink'}" in lines[0]


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


def test_a_rerun_with_other_options_is_refused(mixed: Path, written: Path, capsys) -> None:
    rc, lines = run_cli(
        ["write", "--from", str(mixed), "--out", str(written), "--val-fraction", "0.3", "--shard-size-mb", "0.15"],
        capsys,
    )
    assert rc == 2 and lines == [
        f"shards error: {written} holds a write with other sources or options (use another --out, or delete {written})"
    ]


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
