"""Shards written by the real webdataset package, as ImageNet-style sets are published (issue 38,
item 8): labels only in `.json`, keys that keep the file name's dots (`n01_3.JPEG` -> member
`n01_3.JPEG.jpg`), read with the documented option (`--label json:label`, data.shard_label); and the
wids shard list (`shardindex.json`) written beside every set index, read by wids itself."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from torchlaunch import config as config_mod
from torchlaunch.config import DataConfig
from torchlaunch.data.checks import check_data
from torchlaunch.data.shards import ShardError, ShardSet
from torchlaunch.data.shards.cli import main as shards_main
from torchlaunch.data.shards.index import WIDS_INDEX
from torchlaunch.exit_codes import ConfigError

wds = pytest.importorskip("webdataset")
pytestmark = pytest.mark.timeout(120)


def jpeg(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((12 + value, 16, 3), value * 40, np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def wds_set(root: Path, fields: tuple[str, ...]) -> dict[str, list[tuple[str, int]]]:
    """train/ and val/ written by webdataset's ShardWriter with ImageNet-style dotted keys; `fields`:
    which label members each sample carries (json: {"label": c, "class_name": ...}, cls: digits)."""
    written = {}
    for split, n in (("train", 14), ("val", 6)):
        (root / split).mkdir(parents=True)
        rows = []
        with wds.ShardWriter(str(root / split / f"{split}-%06d.tar"), maxcount=5, verbose=0) as sink:
            for j in range(n):
                c = j % 3
                key = f"n{c:08d}_{j}.JPEG"
                sample = {"__key__": key, "jpg": jpeg(c)}
                if "json" in fields:
                    sample["json"] = {"label": c, "class_name": f"class {c}", "filename": key}
                if "cls" in fields:
                    sample["cls"] = c
                sink.write(sample)
                rows.append((key.split(".")[0], c))
        written[split] = rows
    return written


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_json_labels_and_dotted_keys_read_with_the_label_option(tmp_path: Path, capsys) -> None:
    written = wds_set(tmp_path, ("json",))
    # without the option: one line that points at --label, not at the (good) shard
    assert shards_main(["index", str(tmp_path)]) == 2
    line = one_line(capsys)
    assert "--label json:label" in line and "replace the shard" not in line, line
    assert shards_main(["index", str(tmp_path), "--label", "json:label"]) == 0
    capsys.readouterr()
    ss = ShardSet.open(tmp_path / "train", label="json:label")
    assert [(ss.key(i), int(ss.labels[i])) for i in range(len(ss))] == written["train"]
    assert ss.where(0) == "train-000000.tar member n00000000_0.JPEG.jpg"  # the member's real name
    # webdataset's own reading of the same shards: the same keys and labels, in the same order
    urls = [str(p) for p in sorted((tmp_path / "train").glob("*.tar"))]
    theirs = [(s["__key__"], int(s["jpeg.json"]["label"])) for s in wds.WebDataset(urls, shardshuffle=False).decode()]
    assert theirs == written["train"]
    # training's path: the pre-check and the shard loader, with the config field
    cfg = DataConfig(name="shards", root=str(tmp_path), shard_label="json:label", image_size=16)
    check_data(cfg, local=True)
    from torchlaunch.worker.data.shards import load_shards

    bundle = load_shards(cfg)
    assert bundle.train.labels.tolist() == [c for _, c in written["train"]]
    assert tuple(bundle.train.decode(3, 16).shape) == (3, 16, 16)
    # the config's default (cls) on a set indexed from json: one line naming both fixes
    with pytest.raises(ShardError) as e:
        ShardSet.open(tmp_path / "train")
    assert "data.shard_label=json:label" in str(e.value) and "\n" not in str(e.value)


def test_dotted_keys_with_cls_labels_index_by_default(tmp_path: Path, capsys) -> None:
    """n01_3.JPEG.jpg + n01_3.JPEG.cls: webdataset's key n01_3, the member types jpg and cls (their
    last extension, as webdataset's decoders take them). The old index refused: no image member."""
    written = wds_set(tmp_path, ("cls",))
    assert shards_main(["index", str(tmp_path)]) == 0, capsys.readouterr().err
    ss = ShardSet.open(tmp_path / "val")
    assert [(ss.key(i), int(ss.labels[i])) for i in range(len(ss))] == written["val"]


def test_another_label_source_reindexes_the_same_bytes_but_not_changed_ones(tmp_path: Path, capsys) -> None:
    """The label option and the changed-bytes refusal together (issue 38 items 2 and 8): indexes
    rebuilt from another label source over the same bytes are no change to accept; a shard whose bytes
    changed since it was indexed is refused under any source unless --accept-changed; verify takes
    the set whichever source its indexes were built from."""
    wds_set(tmp_path, ("cls", "json"))
    assert shards_main(["index", str(tmp_path)]) == 0
    capsys.readouterr()
    assert shards_main(["index", str(tmp_path), "--label", "json:label"]) == 0
    assert "indexed" in capsys.readouterr().err  # rebuilt, not kept as built from .cls
    assert ShardSet.open(tmp_path / "train", label="json:label").labels.tolist() == [j % 3 for j in range(14)]
    assert shards_main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    shard = tmp_path / "train" / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the tar's end padding: still a readable tar, other bytes than the index's
    shard.write_bytes(bytes(data))
    assert shards_main(["index", str(tmp_path)]) == 2
    assert "differs from its index" in one_line(capsys)
    assert shards_main(["index", str(tmp_path), "--accept-changed"]) == 0


def test_a_bad_label_source_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    with pytest.raises(ConfigError) as e:
        config_mod.load(None, ["data.shard_label=JSON:label label"])
    assert "data.shard_label" in str(e.value) and "\n" not in str(e.value)
    assert config_mod.load(None, ["data.shard_label=json:label"]).data.shard_label == "json:label"
    wds_set(tmp_path, ("json",))
    assert shards_main(["index", str(tmp_path), "--label", "json:"]) == 2
    assert "label source 'json:'" in one_line(capsys)
    assert not list(tmp_path.rglob("*.idx"))  # refused before anything is written
    assert shards_main(["index", str(tmp_path), "--label", "json:class_name"]) == 2  # a string, not a class index
    assert "has no class index in field 'class_name'" in one_line(capsys)
    with wds.TarWriter(str(tmp_path / "train" / "train-000000.tar")) as sink:  # a label past int64
        sink.write({"__key__": "big", "jpg": jpeg(1), "json": {"label": 10**19}})
    assert shards_main(["index", str(tmp_path), "--label", "json:label"]) == 2
    assert "member big.json has no class index in field 'label'" in one_line(capsys)


def test_wids_reads_the_emitted_shard_list(tmp_path: Path, capsys) -> None:
    wids = pytest.importorskip("wids")
    written = wds_set(tmp_path / "set", ("json",))
    assert shards_main(["index", str(tmp_path / "set"), "--label", "json:label"]) == 0
    listing = tmp_path / "set" / "train" / WIDS_INDEX
    ds = wids.ShardListDataset(str(listing), cache_dir=str(tmp_path / "wids-cache"))
    assert len(ds) == len(written["train"])
    assert [(ds[i]["__key__"], ds[i][".JPEG.json"]["label"]) for i in range(len(ds))] == written["train"]


def test_the_writer_emits_the_wids_shard_list(tmp_path: Path) -> None:
    from torchlaunch.data.shards.writer import write

    for c in range(2):
        (tmp_path / "src" / f"c{c}").mkdir(parents=True)
        for j in range(3):
            (tmp_path / "src" / f"c{c}" / f"{j}.jpg").write_bytes(jpeg(c + j))
    write(tmp_path / "src", tmp_path / "out", val_fraction=0.3)
    import json

    for split in ("train", "val"):
        doc = json.loads((tmp_path / "out" / split / WIDS_INDEX).read_text())
        ss = ShardSet.open(tmp_path / "out" / split)
        assert doc["__kind__"] == "wids-shard-index-v1" and doc["wids_version"] == 1 and doc["name"] == split
        assert [(s["url"], s["nsamples"]) for s in doc["shardlist"]] == [(s.name, s.count) for s in ss.shards]
