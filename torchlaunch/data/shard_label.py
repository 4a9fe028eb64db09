"""Where a shard sample's class index is: the label source `EXT` or `EXT:FIELD`, parsed once.

Why a module of its own beside the shard package (torchlaunch.data.shards) rather than in it: two
parts read it, the shard index (`python -m train.shards index --label`, and the label the index
records) and the shards format's config section (data.shard_label, whose bound is this parser), and
every config load reads that section: importing the shard package would load numpy and PIL into a
process that only parses a config. Pure stdlib.
"""

from __future__ import annotations

import re

SHARD_LABEL = re.compile(r"([a-z0-9_]+(?:\.[a-z0-9_]+)*)(?::([A-Za-z0-9_-]+))?")
"""data.shard_label / `train.shards index --label`: `EXT` (the member KEY.EXT holds the class index as
ASCII digits) or `EXT:FIELD` (KEY.EXT is a JSON object and FIELD its integer class index)."""


def shard_label_parts(spec: str) -> tuple[tuple[str, ...], str | None] | None:
    """(extension components, JSON field or None) of a label source, None when it is not one. The
    extension matches a member's trailing components, as webdataset's decoders match theirs
    (`cls` takes KEY.cls and KEY.JPEG.cls alike)."""
    m = SHARD_LABEL.fullmatch(spec) if isinstance(spec, str) and len(spec) <= 64 else None
    return None if m is None else (tuple(m.group(1).split(".")), m.group(2))
