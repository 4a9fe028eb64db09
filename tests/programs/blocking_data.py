"""A data plug-in whose training set blocks forever on rank 1 after BLOCK_AFTER items (a hung file system,
a stuck network read): `data.name=tests.programs.blocking_data:blobs data.loader=pil data.num_workers=0`."""

from __future__ import annotations

import os
import threading

from examples.my_data import ColorBlobs, color_blobs

BLOCK_AFTER = 1500


class BlockingBlobs(ColorBlobs):
    served = 0

    def __getitem__(self, i: int):  # noqa: ANN204 - the plug-in's item type
        BlockingBlobs.served += 1
        if os.environ.get("RANK") == "1" and BlockingBlobs.served > BLOCK_AFTER:
            threading.Event().wait()  # BLOCKING LINE: never returns
        return super().__getitem__(i)


def blobs(image_size: int = 32):  # noqa: ANN201 - the plug-in contract's triple
    _, val, classes = color_blobs(image_size)
    return BlockingBlobs(1024, image_size, seed=1, as_pil=True), val, classes
