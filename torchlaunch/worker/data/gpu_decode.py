"""`data.decode=gpu`: the training step's JPEGs decoded in one batched call on the rank's GPU.

DataLoader workers do what is cheap on a CPU: read each sample's encoded bytes (a shard member by
pread, or an image file), resolve its RandomResizedCrop box from the plan's variates and the image's
size (index or header), exactly as the CPU path does, and return bytes + box + flip. The rank then
decodes the step's JPEGs with torchvision.io.decode_jpeg(list, device=cuda) (nvJPEG, batched), and
crops, resizes (antialiased bilinear) and mirrors each on the device (`resized_crops`). So the same
sample gets the same box and flip at the same global step on either path, any world size and any
worker count; only the resampling arithmetic differs (float on the device, rounded to uint8).

What the GPU decoder may not handle is decoded on the CPU in the worker, for that sample only, by the
CPU path's own function: anything but a baseline JPEG in RGB or grey (PNG in a tar, CMYK, progressive),
and a member whose header size disagrees with the index. Evaluation stays on the CPU path.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

import torch
from PIL import Image

from torchlaunch.config import ConfigError
from torchlaunch.data.folders import DECODE_ERRORS, decode_error
from torchlaunch.worker.data.augment import centre_box, resized_crop_box
from torchlaunch.worker.data.base import SampleReader
from torchlaunch.worker.data.boxes import load_box

GPU_MODES = ("RGB", "L")
"""JPEG colour modes nvJPEG decodes to RGB like PIL does; CMYK/YCCK (Adobe inversion) stay on the CPU."""


def check_device(device: torch.device) -> None:
    """data.decode=gpu needs a CUDA device and torchvision's decoder: otherwise one line, exit 2."""
    if device.type != "cuda":
        raise ConfigError(
            "data.decode",
            f"gpu decodes JPEGs with nvJPEG on a CUDA device and this rank runs on {device.type}",
            "use data.decode=cpu",
        )
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError:
        raise ConfigError(
            "data.decode",
            "gpu needs torchvision (torchvision.io.decode_jpeg)",
            "install torchvision, or use data.decode=cpu",
        ) from None


def _is_shards(source: list[str] | SampleReader) -> bool:
    from torchlaunch.worker.data.shards import ShardSamples

    return isinstance(source, ShardSamples)


def _bad(where: str, e: BaseException, shard: bool) -> Exception:
    """An undecodable sample named as the CPU path names it (shard member or image file), exit 2."""
    if shard:
        from torchlaunch.data.shards.decode import FIX
        from torchlaunch.data.shards.errors import ShardError

        return ShardError(f"{where} cannot be decoded ({type(e).__name__}: {e})", FIX)
    return decode_error(where, e)


class EncodedDataset(torch.utils.data.Dataset):
    """The worker side of data.decode=gpu. Item (i, variates, flip) as the CPU path's _BoxDataset
    (variates None: the evaluation view). Returns a dict: `data` (the encoded JPEG as a 1-D uint8
    tensor, or the CPU-decoded uint8 (3, S, S) image for a sample the GPU decoder cannot take),
    `encoded` (which of the two), `label`, `box` (left, top, w, h: the CPU path's box), `flip`, `where`."""

    def __init__(self, files: list[str] | SampleReader, labels: torch.Tensor, size: int, resize: int) -> None:
        self.files, self.labels, self.size, self.resize = files, labels, size, resize
        self.shards = _is_shards(files)

    def __len__(self) -> int:
        return len(self.files)

    def box_of(self, variates: Any) -> Any:
        if variates is None:
            return lambda width, height: centre_box(width, height, self.size, self.resize)
        return lambda width, height: resized_crop_box(variates, width, height)

    def read(self, i: int) -> tuple[bytes, str, tuple[int, int] | None]:
        """Sample i's encoded bytes, its name for messages and its size when the index knows it."""
        if self.shards:
            j = int(self.files.index[i])  # type: ignore[union-attr]
            return self.files.shards.read(j), self.files.shards.where(j), self.files.size(i)  # type: ignore[union-attr]
        path = self.files[i]  # type: ignore[index]
        try:
            with open(path, "rb") as f:
                return f.read(), path, None
        except OSError as e:
            raise decode_error(path, e) from None

    def __getitem__(self, item: tuple[int, Any, bool]) -> dict[str, Any]:
        i, variates, flip = item
        label, box_of = int(self.labels[i]), self.box_of(variates)
        if isinstance(self.files, SampleReader) and not self.shards:  # a plug-in's reader: no bytes to hand on
            return self._on_cpu(i, box_of, flip, label, f"sample {i}")
        data, where, known = self.read(i)
        try:
            with Image.open(BytesIO(data)) as im:
                fmt, mode, header_size = im.format, im.mode, im.size
                progressive = bool(im.info.get("progressive") or im.info.get("progression"))
        except DECODE_ERRORS as e:
            raise _bad(where, e, self.shards) from None
        width, height = known or header_size
        if fmt != "JPEG" or mode not in GPU_MODES or progressive or header_size != (width, height):
            return self._on_cpu(i, box_of, flip, label, where)
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        box = box_of(width, height)
        return {
            "data": encoded,
            "encoded": True,
            "label": label,
            "box": box,
            "flip": bool(flip),
            "where": where,
            "shards": self.shards,
        }

    def _on_cpu(self, i: int, box_of: Any, flip: bool, label: int, where: str) -> dict[str, Any]:
        """The CPU path's own decode + crop for this sample only: the same pixels and box as data.decode=cpu."""
        image, box = load_box(self.files, i, box_of, self.size, bool(flip))
        return {
            "data": image,
            "encoded": False,
            "label": label,
            "box": box,
            "flip": bool(flip),
            "where": where,
            "shards": self.shards,
        }


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A step's samples as lists (encoded members differ in length) plus the boxes, flips and labels."""
    return {
        "data": [s["data"] for s in samples],
        "encoded": [s["encoded"] for s in samples],
        "where": [s["where"] for s in samples],
        "shards": bool(samples and samples[0]["shards"]),
        "labels": torch.tensor([s["label"] for s in samples], dtype=torch.int64),
        "boxes": torch.tensor([s["box"] for s in samples], dtype=torch.float64),
        "flips": torch.tensor([s["flip"] for s in samples], dtype=torch.bool),
    }


def resized_crops(images: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """Each uint8 (3, H, W) image's box (left, top, w, h) resized to size x size (antialiased bilinear,
    torchvision's crop-then-resize), mirrored where `flips` says, as one uint8 (N, 3, S, S) batch on the
    images' device. Training boxes are whole pixels; a fractional box (the evaluation view) is rounded
    to whole pixels here (at most half a pixel at its edges). Runs on any device (tests use the CPU)."""
    device = images[0].device if images else torch.device("cpu")
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    for k, (image, box, flip) in enumerate(zip(images, boxes.tolist(), flips.tolist(), strict=True)):
        left, top = round(box[0]), round(box[1])
        right, bottom = round(box[0] + box[2]), round(box[1] + box[3])
        crop = image[:, top:bottom, left:right]
        if crop.shape[1:] != (size, size):
            crop = torch.nn.functional.interpolate(
                crop[None].float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False
            )[0]
            crop = crop.round_().clamp_(0, 255)
        out[k] = crop.flip(-1) if flip else crop
    return out


def decode_batch(
    encoded: list[torch.Tensor], where: list[str], device: torch.device, shards: bool = True
) -> list[torch.Tensor]:
    """The encoded JPEGs as RGB uint8 (3, H, W) images on `device`, in one batched decode. A member the
    batched call fails on is found by decoding one by one and named in one line (exit 2)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not encoded:
        return []
    try:
        return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        for data, name in zip(encoded, where, strict=True):
            try:
                decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
            except RuntimeError as e:
                raise _bad(name, e, shards) from None
        raise


def to_batch(batch: dict[str, Any], size: int, device: torch.device) -> list[torch.Tensor]:
    """A collated step -> [uint8 (N, 3, S, S) images on `device`, labels, boxes]: the CPU path's batch."""
    data, encoded = batch["data"], batch["encoded"]
    jpeg = [k for k, e in enumerate(encoded) if e]
    decoded = decode_batch([data[k] for k in jpeg], [batch["where"][k] for k in jpeg], device, batch["shards"])
    images = torch.empty((len(data), 3, size, size), dtype=torch.uint8, device=device)
    if jpeg:
        at = torch.tensor(jpeg, dtype=torch.int64)
        images[at.to(device)] = resized_crops(decoded, batch["boxes"][at], batch["flips"][at], size)
    for k, e in enumerate(encoded):
        if not e:
            images[k] = data[k].to(device, non_blocking=True)
    return [images, batch["labels"], batch["boxes"]]
