"""Tar shards in the webdataset layout, with an offset index: write, index, verify, random access.

    from torchlaunch.data.shards import ShardSet, decode
    train = ShardSet.open("DIR/train")
    image = decode(train.read(i), train.where(i))       # RGB PIL image; train.labels[i] its class

Torch-free at import (numpy, PIL, xxhash), so launchers, the pre-check and the doctor can open a set.
"""

from torchlaunch.data.shards.decode import decode, to_rgb
from torchlaunch.data.shards.errors import ShardError
from torchlaunch.data.shards.reader import ShardSet

__all__ = ["ShardError", "ShardSet", "decode", "to_rgb"]
