"""The shards data format: a tar shard set in the webdataset layout (torchlaunch.data.shards writes,
indexes, verifies and reads it). One module: its config section, pre-check and registry entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torchlaunch.base.rules import bound
from torchlaunch.data.registry import DataConfig, DataFormat, lazy, register
from torchlaunch.data.shard_label import shard_label_parts
from torchlaunch.exit_codes import BadInput

SHARD_MANIFEST = "manifest.json"


def check_shard_set(cfg: DataConfig, local: bool) -> None:
    """The registry's pre-check of data.name=shards (check_shards on the configured root and label)."""
    check_shards(Path(cfg.root).expanduser(), cfg.shard_label)


def check_shards(root: Path, label: str = "cls") -> None:
    """A shard set every rank can open: train/ and val/ present with indexes matching their shards
    (ShardSet.open checks them), the same classes in both, at least 2, and the first sample of each
    split decodable. Reads two samples, not the set: a member damaged further in is named by the
    worker that reads it (and by `python -m train.shards verify`)."""
    from torchlaunch.data.shards import ShardSet, decode  # numpy + PIL: loaded when a launcher checks

    splits = {name: ShardSet.open(root / name, label=label, remember=True) for name in ("train", "val")}
    train, val = splits["train"], splits["val"]
    if list(train.classes) != list(val.classes) or len(train.classes) < 2:
        raise BadInput(
            f"data error: {root}: train/ has {len(train.classes)} classes and val/ {len(val.classes)}; both need "
            "the same list of at least 2 (rewrite the set with python -m train.shards write)"
        )
    for s in (train, val):
        if len(s) == 0:
            raise BadInput(
                f"data error: {s.folder} holds no samples (rewrite the set with python -m train.shards write)"
            )
        decode(s.read(0), s.where(0), None)


@dataclass
class ShardsOptions:
    """shards' own keys."""

    shard_label: str = field(
        default="cls",
        metadata=bound(
            lambda v: shard_label_parts(v) is not None,
            "must be EXT or EXT:FIELD (lower-case extension, optional JSON field)",
            "e.g. data.shard_label=json:label",
        ),
    )
    """shards only: where a sample's class index is: `cls` (KEY.cls, ASCII digits), another extension
    holding digits, or `EXT:FIELD` (an integer field of a JSON member, e.g. `json:label`, the layout of
    webdataset sets with `.json` labels). The set's indexes must be built from the same source:
    `python -m train.shards index DIR --label json:label`."""


register(
    DataFormat(
        name="shards",
        summary="a tar shard set",
        load=lazy("torchlaunch.worker.data.shards:load_shards"),
        precheck=check_shard_set,
        eval_set=lazy("torchlaunch.worker.data.shards:shards_eval_set"),
        detect=lambda root: (root / SHARD_MANIFEST).is_file(),
        held_out=("all", "val"),
        gpu_decode=True,
        options=ShardsOptions,
    )
)
