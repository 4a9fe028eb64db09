"""The offset index: one small binary file per shard (`NAME.tar.idx`) and one per set folder
(`shards.idx`, the per-shard indexes concatenated), so opening a set reads one file.

Layout (little-endian): magic `TLSHIDX1`, u32 format version, u32 header length, u64 xxh3_64 of the
header, the JSON header (kind, the shards with name/size/xxh3/sample count, and where each column
lies with its xxh3_64), then the columns, each at a 64-byte boundary:

    offset  <u8    byte offset of the image member's data in its shard
    nbytes  <u4    its size
    label   <i8    class index from KEY.cls
    size    <i4 x2 width, height from the image header (PIL open, no decode)
    xxh3    <u8    xxh3_64 of the member's bytes: a read checks it (~10 us for 100 KB)
    ext     u1     index into EXTS: the member is STEM.<ext>
    key     S<k>   the image member's name without its last extension (STEM): the sample key, plus
                   what follows the key's first dot when the name holds more (n01_1.JPEG.jpg: n01_1.JPEG);
                   read one row at a time, when an error line names a member

The header also records where the labels came from (`label`: `cls` when absent, else the
`--label` source such as `json:label`): a set opened with another data.shard_label is refused.

Why not one .npy per column or an npz: one file is one open and one read at start-up, and the header
carries the shard's size and checksum next to the arrays it describes, so an index can never be
paired with arrays of another shard. For 1,281,167 samples the numeric columns are 47 MB: read in one
go and checked, well inside the 2 s / 100 MB budget; keys stay on disk until an error names one.
"""

from __future__ import annotations

import json
import os
import struct
import tarfile
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash
from PIL import Image

from torchlaunch.base.untrusted import load_json, quote
from torchlaunch.data.shard_label import shard_label_parts
from torchlaunch.data.shards.bounds import MAX_CLASSES, check_index, column_layout
from torchlaunch.data.shards.errors import ShardError, shown
from torchlaunch.data.shards.fsio import open_regular, write_durable

MAGIC = b"TLSHIDX1"
VERSION = 1
PREAMBLE = struct.Struct("<8sIIQ")
ALIGN = 64
EXTS = ("jpg", "jpeg", "png", "webp")
IMAGE_EXTS = frozenset(EXTS)
INDEX_SUFFIX = ".idx"
SET_INDEX = "shards.idx"
COLUMNS = {"offset": "<u8", "nbytes": "<u4", "label": "<i8", "size": "<i4", "xxh3": "<u8", "ext": "u1"}
REINDEX = "rebuild it: python -m train.shards index DIR"
MAX_HEADER = 64 << 20
DEFAULT_LABEL = "cls"
MAX_JSON_LABEL = 1 << 20
"""A JSON label member larger than this is refused unread (timm's are ~100 bytes)."""
LABEL_FIX = (
    "if its class is in another member, build the indexes from that one, e.g. "
    "python -m train.shards index DIR --label json:label, and train with data.shard_label=json:label"
)
WIDS_INDEX = "shardindex.json"
"""The wids shard list written beside each set index (the name `widsindex create` writes by default)."""


@dataclass
class ShardInfo:
    """One shard as its index saw it."""

    name: str
    size: int
    xxh3: str
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "xxh3": self.xxh3, "count": self.count}


@dataclass
class Index:
    """A loaded index: its shards (in sample order) and the numeric columns; keys on demand."""

    path: Path
    kind: str
    shards: list[ShardInfo]
    columns: dict[str, np.ndarray]
    header: dict[str, Any] = field(repr=False)

    def __len__(self) -> int:
        return int(self.columns["label"].shape[0])

    def keys(self) -> np.ndarray:
        return _column(self.path, self.header, "key")

    @property
    def label(self) -> str:
        """Where the labels came from: `cls`, or the `--label` source the index was built with."""
        return str(self.header.get("label", DEFAULT_LABEL))

    def key_column(self) -> KeyColumn:
        """Where the key column lies, for read_key: an error line reads one key, not a column of
        1.28 M (38 MB at ImageNet scale, read by every process that erred). Its description is checked
        here (bounds.column_layout) but a fault is kept, not raised: keys only name samples, so a
        forged key column is named where a key is read (verify), and a loader's line says `#ROW`."""
        d = self.header["columns"]["key"]
        try:
            dtype, shape, _ = column_layout(f"index {self.path}", "key", d, None, self.header["file_size"], REINDEX)
        except ShardError as e:
            return KeyColumn(self.path, 0, 0, 0, str(e))
        return KeyColumn(self.path, self.header["data_start"] + int(d["at"]), dtype.itemsize, shape[0])


class KeyColumn(NamedTuple):
    """An index's key column (Index.key_column): its file, byte offset, row width and rows, or why
    its description cannot be trusted (`fault`, the error line read_key raises)."""

    path: Path
    at: int
    width: int
    rows: int
    fault: str | None = None


def read_key(fd: int, column: KeyColumn, row: int) -> bytes:
    """Row `row` of a key column (Index.key_column; `fd` its file, open), trailing NULs stripped as
    numpy's S dtype does."""
    if column.fault is not None:
        raise ShardError(column.fault)
    if not 0 <= row < column.rows:
        raise ShardError(f"index {column.path} has no key {row} (it holds {column.rows})", REINDEX)
    return os.pread(fd, column.width, column.at + row * column.width).rstrip(b"\0")


def index_path(shard: Path) -> Path:
    return shard.with_name(shard.name + INDEX_SUFFIX)


def file_xxh3(fd: int, size: int) -> str:
    """xxh3_64 of a whole file (hex), read in 8 MB chunks."""
    h = xxhash.xxh3_64()
    done = 0
    while done < size:
        chunk = os.pread(fd, min(8 << 20, size - done), done)
        if not chunk:
            break
        h.update(chunk)
        done += len(chunk)
    return h.hexdigest()


def pack(kind: str, shards: list[ShardInfo], columns: dict[str, np.ndarray], label: str = DEFAULT_LABEL) -> list[bytes]:
    """The bytes of an index file (see the module docstring)."""
    blobs: list[tuple[str, np.ndarray]] = [(n, np.ascontiguousarray(columns[n], dtype=COLUMNS[n])) for n in COLUMNS]
    keys = np.asarray(columns["key"])
    blobs.append(("key", np.ascontiguousarray(keys if keys.dtype.kind == "S" and keys.size else keys.astype("S1"))))
    described: dict[str, Any] = {}
    header: dict[str, Any] = {"kind": kind, "shards": [s.to_json() for s in shards], "columns": described}
    if label != DEFAULT_LABEL:  # absent = cls: indexes written before the option keep their bytes
        header["label"] = label
    # offsets depend on the header's length, which depends on the offsets: fix them relative to the data start
    at = 0
    for name, arr in blobs:
        described[name] = {
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "at": at,
            "xxh3": xxhash.xxh3_64(arr.data).hexdigest(),
        }
        at += -(-arr.nbytes // ALIGN) * ALIGN
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    start = -(-(PREAMBLE.size + len(raw)) // ALIGN) * ALIGN
    parts = [PREAMBLE.pack(MAGIC, VERSION, len(raw), xxhash.xxh3_64(raw).intdigest()), raw]
    parts.append(b"\0" * (start - PREAMBLE.size - len(raw)))
    for _name, arr in blobs:
        parts.append(arr.tobytes())
        parts.append(b"\0" * (-arr.nbytes % ALIGN))
    header["data_start"] = start  # the reader recomputes this the same way; kept out of the stored JSON
    return parts


def _header(path: Path, fd: int, size: int) -> dict[str, Any]:
    fix = REINDEX
    pre = os.pread(fd, PREAMBLE.size, 0)
    if len(pre) < PREAMBLE.size:
        raise ShardError(f"index {path} is truncated ({size} bytes)", fix)
    magic, version, hlen, hsum = PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise ShardError(f"index {path} is not a torchlaunch shard index (foreign file)", fix)
    if version > VERSION:
        raise ShardError(
            f"index {path} has format version {version}, newer than this torchlaunch's {VERSION}",
            "upgrade torchlaunch, or rebuild the index with this one: python -m train.shards index DIR",
        )
    if version < 1 or hlen > MAX_HEADER or PREAMBLE.size + hlen > size:
        raise ShardError(f"index {path} has a damaged header", fix)
    raw = os.pread(fd, hlen, PREAMBLE.size)
    if len(raw) != hlen or xxhash.xxh3_64(raw).intdigest() != hsum:
        raise ShardError(f"index {path} has a damaged header (checksum mismatch)", fix)
    try:
        header = load_json(raw)
        header["data_start"] = -(-(PREAMBLE.size + hlen) // ALIGN) * ALIGN
        header["file_size"] = size
        header["shards"] = [
            ShardInfo(str(s["name"]), int(s["size"]), str(s["xxh3"]), int(s["count"])) for s in header["shards"]
        ]
        for c in list(COLUMNS) + ["key"]:
            d = header["columns"][c]
            np.dtype(d["dtype"]), int(d["at"]), [int(x) for x in d["shape"]], str(d["xxh3"])
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise ShardError(f"index {path} has a damaged header ({type(e).__name__})", fix) from None
    return header


def _read_column(path: Path, fd: int, header: dict[str, Any], name: str) -> np.ndarray:
    d = header["columns"][name]
    dtype, shape, nbytes = column_layout(f"index {path}", name, d, COLUMNS.get(name), header["file_size"], REINDEX)
    at = header["data_start"] + int(d["at"])
    if at + nbytes > header["file_size"]:
        raise ShardError(f"index {path} is truncated (column {name} ends past the file)", REINDEX)
    buf = bytearray(nbytes)
    got = os.preadv(fd, [buf], at) if nbytes else 0
    if got != nbytes or xxhash.xxh3_64(buf).hexdigest() != d["xxh3"]:
        raise ShardError(f"index {path} is corrupt (column {name} fails its checksum)", REINDEX)
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    arr.flags.writeable = False
    return arr


def _column(path: Path, header: dict[str, Any], name: str) -> np.ndarray:
    fd, _size = open_regular(path, "index", REINDEX)
    try:
        return _read_column(path, fd, header, name)
    finally:
        os.close(fd)


def load(path: Path, kind: str | None = None) -> Index:
    """Read an index (numeric columns checked against their checksums); ShardError when it is not one."""
    fd, size = open_regular(path, "index", REINDEX)
    try:
        header = _header(path, fd, size)
        if kind is not None and header.get("kind") != kind:
            raise ShardError(f"index {path} is a {header.get('kind')!r} index, expected {kind!r}", REINDEX)
        columns = {name: _read_column(path, fd, header, name) for name in COLUMNS}
    finally:
        os.close(fd)
    n = columns["label"].shape[0]
    if any(c.shape[0] != n for c in columns.values()) or columns["size"].shape != (n, 2):
        raise ShardError(f"index {path} is inconsistent (columns of different lengths)", REINDEX)
    check_index(f"index {path}", header["shards"], columns, len(EXTS), REINDEX)
    return Index(path=path, kind=header["kind"], shards=header["shards"], columns=columns, header=header)


def split_name(name: str) -> tuple[str, str] | None:
    """webdataset's rule: the key is the path up to the first dot of the basename, the rest (lower-cased)
    the extension; a basename without a dot (or starting with one) belongs to no sample."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None
    return name[:dot], name[dot + 1 :].lower()


def _member_where(shard: Path, member: str) -> str:
    return f"{shown(shard.name)} member {shown(member)}"


def _utf8(key: str) -> bool:
    """A member name tarfile decoded is UTF-8 text (names that are not come as surrogate escapes, which
    neither the key column nor webdataset's readers can hold)."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def label_source(label: str) -> tuple[tuple[str, ...], str | None]:
    """The parsed `--label` / data.shard_label (torchlaunch.data.shard_label); ShardError if bad."""
    parts = shard_label_parts(label)
    if parts is None:
        raise ShardError(f"label source {label!r} is not EXT or EXT:FIELD", "e.g. --label cls or --label json:label")
    return parts


def json_label(data: bytes, field: str) -> int | None:
    """The class index in a JSON member's field, None when the member is no object with an integer
    in 0..MAX_CLASSES-1 there (the bound the index holds every label to: bounds.MAX_CLASSES)."""
    try:
        doc = load_json(data)  # untrusted: nesting bounded, NaN refused, bytes that are not UTF-8 a ValueError
    except (ValueError, RecursionError):
        return None
    value = doc.get(field) if isinstance(doc, dict) else None
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_CLASSES
    return value if ok else None


def build(shard: Path, label: str = DEFAULT_LABEL) -> tuple[ShardInfo, dict[str, np.ndarray]]:
    """Scan one tar shard in the webdataset layout: every sample's image member and label.

    Members are grouped by key as webdataset does (the key ends at the first dot of the basename, the
    rest, lower-cased, is the member's extension), and a member's type is its last extension
    component, as webdataset's decoders read it: n01_1.JPEG.jpg is sample n01_1's image. Every sample
    needs one image member (jpg/jpeg/png/webp) and its label from `label` (label_source): by default a
    KEY.cls holding the class index as ASCII digits; with `json:label`, the integer `label` field of
    KEY.json. Other members are ignored, as webdataset's readers do."""
    fix = "replace the shard with a good copy, or rewrite it with python -m train.shards write"
    want, field_name = label_source(label)
    fd, size = open_regular(shard, "shard", fix)
    rows: list[tuple[int, int, int, int, int, int, int, bytes]] = []
    try:
        f = os.fdopen(os.dup(fd), "rb")
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except tarfile.TarError as e:
            raise ShardError(f"shard {shard} is not a readable tar ({e})", fix) from None
        current: str | None = None
        sample: dict[str, Any] = {}

        def finish() -> None:
            if current is None:
                return
            if "image" not in sample:
                raise ShardError(
                    f"shard {shown(shard.name)}: sample {shown(current)} has no image member (.jpg/.jpeg/.png/.webp)",
                    fix,
                )
            if "label" not in sample:
                raise ShardError(
                    f"shard {shown(shard.name)}: sample {shown(current)} has no {shown(current + '.' + want[-1])} member",
                    LABEL_FIX,
                )
            off, n, ext, digest, w, h, stem = sample["image"]
            rows.append((off, n, sample["label"], w, h, digest, ext, stem.encode()))

        try:
            for m in tf:
                if not m.isfile():
                    continue
                parts = split_name(m.name)
                if parts is None:
                    continue
                key, ext = parts
                if not m.name.isascii() and not _utf8(m.name):  # the key, or the stem a dotted key keeps
                    raise ShardError(f"{_member_where(shard, m.name)} has a name that is not UTF-8 text", fix)
                kinds = ext.split(".")
                if key != current:
                    finish()
                    current, sample = key, {}
                if m.offset_data + m.size > size:
                    raise ShardError(
                        f"shard {shard} is truncated: {_member_where(shard, m.name)} ends past the file", fix
                    )
                exact = ext in IMAGE_EXTS  # KEY.jpg wins over KEY.depth.png whatever the member order
                if kinds[-1] in IMAGE_EXTS and ("image" not in sample or (exact and not sample["exact"])):
                    data = os.pread(fd, m.size, m.offset_data)
                    try:
                        with Image.open(BytesIO(data)) as im:
                            w, h = im.size
                    except Exception as e:  # PIL raises many types for a bad header
                        raise ShardError(
                            f"{_member_where(shard, m.name)} is not a readable image ({type(e).__name__}: {e})", fix
                        ) from None
                    stem = m.name[: len(m.name) - len(kinds[-1]) - 1]
                    member_xxh3 = xxhash.xxh3_64(data).intdigest()
                    sample["image"] = (m.offset_data, m.size, EXTS.index(kinds[-1]), member_xxh3, w, h, stem)
                    sample["exact"] = exact
                elif "label" in sample or tuple(kinds[-len(want) :]) != want:
                    continue
                elif field_name is not None:
                    found = (
                        None if m.size > MAX_JSON_LABEL else json_label(os.pread(fd, m.size, m.offset_data), field_name)
                    )
                    if found is None:
                        raise ShardError(
                            f"{_member_where(shard, m.name)} has no class index in field {field_name!r} "
                            f"(an integer 0-{MAX_CLASSES - 1})",
                            f"check the label source: --label {label} / data.shard_label={label}",
                        )
                    sample["label"] = found
                else:
                    text = os.pread(fd, min(m.size, 64), m.offset_data)
                    try:
                        value = int(text.decode("ascii").strip())
                    except (UnicodeDecodeError, ValueError):
                        value = -1
                    if value < 0 or m.size > 64:
                        raise ShardError(
                            f"{_member_where(shard, m.name)} does not hold a class index (ASCII digits)", fix
                        )
                    if value >= MAX_CLASSES:
                        raise ShardError(
                            f"{_member_where(shard, m.name)} holds class {quote(text.decode('ascii', 'replace').strip(), 40)}, "
                            f"above the limit of {MAX_CLASSES - 1}",
                            fix,
                        )
                    sample["label"] = value
            finish()
        except tarfile.TarError as e:
            raise ShardError(f"shard {shard} is a damaged tar ({e})", fix) from None
        finally:
            f.close()
        digest = file_xxh3(fd, size)
    finally:
        os.close(fd)
    if not rows:
        raise ShardError(f"shard {shard} holds no samples (expected KEY.jpg + KEY.{want[-1]} members)", fix)
    cols = list(zip(*rows, strict=True))
    columns = {
        "offset": np.array(cols[0], dtype="<u8"),
        "nbytes": np.array(cols[1], dtype="<u4"),
        "label": np.array(cols[2], dtype="<i8"),
        "size": np.stack([np.array(cols[3], dtype="<i4"), np.array(cols[4], dtype="<i4")], axis=1),
        "xxh3": np.array(cols[5], dtype="<u8"),
        "ext": np.array(cols[6], dtype="u1"),
        "key": np.array(cols[7], dtype=f"S{max(len(k) for k in cols[7])}"),
    }
    info = ShardInfo(shard.name, size, digest, len(rows))
    check_index(f"shard {shard}", [info], columns, len(EXTS), fix)
    return info, columns


def write_shard_index(shard: Path, label: str = DEFAULT_LABEL) -> Index:
    """Build and durably write `shard`'s index; returns it as loaded back."""
    info, columns = build(shard, label)
    write_durable(index_path(shard), pack("shard", [info], columns, label))
    return load(index_path(shard), "shard")


def concat(parts: list[Index]) -> tuple[list[ShardInfo], dict[str, np.ndarray]]:
    shards = [s for p in parts for s in p.shards]
    columns = {name: np.concatenate([p.columns[name] for p in parts]) for name in COLUMNS}
    keys = [p.keys() for p in parts]
    width = max((k.dtype.itemsize for k in keys), default=1)
    columns["key"] = np.concatenate([k.astype(f"S{width}") for k in keys]) if keys else np.zeros(0, "S1")
    return shards, columns


def write_set_index(folder: Path, parts: list[Index]) -> None:
    """The set index of a split folder, and wids' shard list beside it (write_wids)."""
    labels = sorted({p.label for p in parts})
    if len(labels) > 1:
        raise ShardError(
            f"the indexes in {folder} take labels from {' and '.join(labels)}", f"{REINDEX} --label SOURCE"
        )
    shards, columns = concat(parts)
    write_durable(folder / SET_INDEX, pack("set", shards, columns, labels[0] if labels else DEFAULT_LABEL))
    write_wids(folder, shards)


def write_wids(folder: Path, shards: list[ShardInfo]) -> None:
    """DIR/SPLIT/shardindex.json: the split as a wids shard list, so `wids.ShardListDataset(PATH)` reads
    the set without indexing it again. The format is wids' own (`widsindex create`, webdataset's wids
    package): relative urls resolve against the JSON's folder; no md5sum (wids would check it on every
    open of a shard), filesize for its summary line."""
    doc = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": s.name, "nsamples": s.count, "filesize": s.size} for s in shards],
        "name": folder.name,  # not the parent folder: the same input gives the same bytes wherever it is written
    }
    write_durable(folder / WIDS_INDEX, [json.dumps(doc, indent=1).encode() + b"\n"])


def matches(index: Index, shard: Path) -> bool:
    """A shard index still describes `shard` (same size and whole-file checksum: reads the shard)."""
    info = index.shards[0]
    try:
        fd, size = open_regular(shard, "shard", "")
    except ShardError:
        return False
    try:
        return size == info.size and file_xxh3(fd, size) == info.xxh3
    finally:
        os.close(fd)


__all__ = ["Index", "ShardInfo", "build", "load"]
