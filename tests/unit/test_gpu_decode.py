"""data.decode=gpu (issue 27): DataLoader workers hand on encoded JPEGs with the CPU path's boxes and
flips, and the rank decodes and crops the batch on its device. Everything but nvJPEG itself runs here
on the CPU (torchvision's decode_jpeg and the batched crop accept device="cpu"): the worker side, the
batched crop, the loader wiring and the refusals. The CUDA test is marked gpu and skipped without one."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchlaunch.config import ConfigError, DataConfig
from torchlaunch.config import load as load_config
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.data.shards.writer import write
from torchlaunch.worker.data import Normalizer, TrainLoader, gpu_decode, load_bundle
from torchlaunch.worker.data.loaders import _BoxDataset

pytest.importorskip("torchvision.io")
pytestmark = pytest.mark.timeout(120)

SIZE = 32
CPU = torch.device("cpu")


def _scene(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Smooth colour plus a little noise: decodes and resizes like a photo (pure noise would not)."""
    coarse = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    return (np.asarray(coarse, dtype=np.int16) + rng.integers(-8, 9, (h, w, 3))).clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Class folders of RGB JPEGs of mixed sizes plus the members the GPU decoder does not take (CMYK,
    progressive, PNG) and a grayscale JPEG it does."""
    root = tmp_path_factory.mktemp("gpu-src") / "src"
    rng = np.random.default_rng(1)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for j in range(10):
            w, h = (int(v) for v in rng.integers(40, 130, 2))
            Image.fromarray(_scene(rng, w, h)).save(root / f"c{c}" / f"rgb{j}.jpg", quality=90)
        arr = _scene(rng, 90, 70)
        Image.fromarray(arr).convert("L").save(root / f"c{c}" / "gray.jpg", quality=90)
        Image.fromarray(arr).convert("CMYK").save(root / f"c{c}" / "cmyk.jpg", quality=90)
        Image.fromarray(arr).save(root / f"c{c}" / "prog.jpg", quality=90, progressive=True)
        Image.fromarray(arr).save(root / f"c{c}" / "png.png")
    return root


@pytest.fixture(scope="module")
def shard_root(sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-set") / "set"
    write(sources, out, val_fraction=0.1, shard_size_mb=0.05)
    return out


def _bundle(name: str, root: Path, tmp_path: Path):
    return load_bundle(
        DataConfig(name=name, root=str(root), image_size=SIZE, train_crop="resized", cache_dir=str(tmp_path / "c"))
    )


def _items(n: int, seed: int = 0) -> list[tuple[int, np.ndarray | None, bool]]:
    plan = BatchPlan(n, n - n % 4, seed, train_crop="resized", image_size=SIZE)
    idx, aug = plan.rank_step(plan.permutation(0), 0, 0)
    variates, flips = aug[0].numpy(), aug[1].tolist()
    items = [(i, variates[k], flips[k]) for k, i in enumerate(idx.tolist())]
    return items + [(i, None, False) for i in range(3)]  # and the evaluation view of three samples


@pytest.mark.parametrize("name", ["shards", "imagefolder"])
def test_workers_hand_on_the_cpu_paths_boxes_flips_and_labels(name: str, sources: Path, shard_root: Path, tmp_path):
    bundle = _bundle(name, shard_root if name == "shards" else sources, tmp_path)
    files, labels = bundle.train.files, bundle.train.labels
    cpu = _BoxDataset(files, labels, SIZE, 36)
    gpu = gpu_decode.EncodedDataset(files, labels, SIZE, 36)
    kinds = set()
    for item in _items(len(bundle.train)):
        image, label, box = cpu[item]
        out = gpu[item]
        assert out["label"] == label and out["flip"] == bool(item[2])
        assert torch.equal(torch.tensor(out["box"], dtype=torch.float64), box)
        if out["encoded"]:
            assert out["data"].dtype == torch.uint8 and out["data"].dim() == 1
            kinds.add(Image.open(io.BytesIO(out["data"].numpy().tobytes())).mode)
        else:  # decoded on the CPU by the CPU path's own function: the very same pixels
            assert torch.equal(out["data"], image)
            kinds.add("cpu")
    assert kinds == {"RGB", "L", "cpu"}  # both decodable modes went to the GPU; CMYK, progressive, PNG did not


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def decoded_both_ways(shard_root: Path, tmp_path: Path, device: torch.device) -> tuple[Batch, Batch]:
    """The same items' boxes through gpu_decode.to_batch on `device` and through the CPU path: each as
    (images, labels, boxes)."""
    bundle = _bundle("shards", shard_root, tmp_path)
    files, labels = bundle.train.files, bundle.train.labels
    cpu = _BoxDataset(files, labels, SIZE, 36)
    gpu = gpu_decode.EncodedDataset(files, labels, SIZE, 36)
    items = _items(len(bundle.train))
    images, got_labels, boxes = gpu_decode.to_batch(gpu_decode.collate([gpu[it] for it in items]), SIZE, device)
    samples = [cpu[it] for it in items]
    want = [torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])]
    return (images, got_labels, boxes), (*want, torch.stack([s[2] for s in samples]))


def test_batched_crop_on_cpu_is_close_to_the_cpu_path(shard_root: Path, tmp_path: Path) -> None:
    """to_batch with device=cpu (torchvision's CPU decode + the batched crop) against the CPU path's
    images of the same boxes: the same decoded pixels, the resize in float then rounded (rounding
    only); the evaluation's fractional boxes are rounded to whole pixels (half a pixel at most)."""
    (images, got_labels, boxes), (expected, labels, want_boxes) = decoded_both_ways(shard_root, tmp_path, CPU)
    assert images.shape == expected.shape and images.dtype == torch.uint8
    assert torch.equal(got_labels, labels)
    assert torch.equal(boxes, want_boxes)
    diff = (images.int() - expected.int()).abs()
    train = diff[:-3].float()  # a few large differences where the CPU path decoded at a JPEG draft scale
    assert train.mean() < 0.5 and (train > 4).float().mean() < 0.03, (train.mean(), (train > 4).float().mean())
    assert diff[-3:].float().mean() < 6.0  # the rounded evaluation box: a sub-pixel shift of the view


def test_gpu_decode_without_cuda_is_a_config_error(shard_root: Path, tmp_path: Path) -> None:
    bundle = _bundle("shards", shard_root, tmp_path)
    plan = BatchPlan(len(bundle.train), 8, 0, train_crop="resized", image_size=SIZE)
    norm = Normalizer(bundle.mean, bundle.std, CPU, False)
    with pytest.raises(ConfigError, match=r"data\.decode.*use data\.decode=cpu") as e:
        TrainLoader(bundle.train, plan, norm, CPU, True, 0, SIZE, decode="gpu")
    assert "\n" not in str(e.value)
    for overrides in (["data.name=cifar10", "data.train_crop=resized"], ["data.name=shards"]):
        with pytest.raises(ConfigError, match=r"data\.decode.*data\.decode=cpu"):
            load_config(None, [*overrides, "data.decode=gpu"])
    assert load_config(None, ["data.name=shards", "data.train_crop=resized", "data.decode=gpu"]).data.decode == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nvJPEG); none on this machine")
def test_cuda_decode_matches_the_cpu_path(shard_root: Path, tmp_path: Path) -> None:
    (images, _, boxes), (expected, _, want_boxes) = decoded_both_ways(shard_root, tmp_path, torch.device("cuda", 0))
    assert images.device.type == "cuda"
    assert torch.equal(boxes, want_boxes)
    # nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by a few levels per pixel
    assert (images.cpu().int() - expected.int()).abs()[:-3].float().mean() < 3.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_bench_gpu224_says_it_is_skipped_without_cuda(capsys: pytest.CaptureFixture) -> None:
    from bench import gpu224

    assert gpu224.run() is None
    err = capsys.readouterr().err
    assert "skipped: no CUDA device" in err and "python -m bench.run --only gpu224" in err
