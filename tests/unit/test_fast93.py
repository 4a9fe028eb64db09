"""The 93% recipe (configs/fast93.yaml): fastnet93, cutout drawn per global step, and a tiny run that
resumes bit for bit after an interruption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.unit.test_data import write_folder
from torchlaunch import config
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.data import BatchPlan, ImageSet, Normalizer, TrainLoader, cutout, decode_image
from torchlaunch.worker.models import build_model


def test_recipe_loads_and_validates() -> None:
    cfg = config.load(REPO / "configs" / "fast93.yaml", ["data.root=/somewhere"])
    assert (cfg.model.name, cfg.data.cutout, cfg.train.tta) == ("fastnet93", 12, "flip_translate")
    assert cfg.train.label_smoothing == 0.2 and cfg.train.epochs > 16  # longer than fast.yaml
    assert cfg.data.cutout <= cfg.data.image_size
    assert config.load(None, []).data.cutout == 0  # off unless a recipe asks for it


@pytest.mark.parametrize(
    "override, words",
    [
        ("data.cutout=-1", "must be >= 0"),
        ("data.cutout=40", "larger than data.image_size=32"),
        ("model.name=fastnet94", "unknown value"),
    ],
)
def test_bad_values_are_one_line(override: str, words: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load(REPO / "configs" / "fast93.yaml", [override])
    text = str(err.value)
    key = override.split("=")[0]
    assert text.startswith(f"config error: {key}:") and words in text and "\n" not in text


def test_fastnet93_is_wider_and_residual_and_fastnet_is_unchanged() -> None:
    torch.manual_seed(0)
    model = build_model("fastnet93", 10)
    assert [g.conv2.out_channels for g in model.groups] == [128, 384, 512]
    assert all(hasattr(g, "conv3") for g in model.groups)
    small = build_model("fastnet93", 10, 8)
    assert [g.conv2.out_channels for g in small.groups] == [8, 24, 32]
    images = torch.randn(16, 3, 32, 32)
    small.init_from_data(images)
    assert not small.stem[0].weight.requires_grad and torch.isfinite(small.stem[0].weight).all()
    assert small(images).shape == (16, 10)
    # the residual: zeroing the third conv's path leaves the pooled activation of the group's first half
    group = small.groups[0].eval()
    x = torch.randn(2, 24, 16, 16)
    with torch.no_grad():
        group.conv3.weight.zero_()
        group.norm3.bias.fill_(-1e4)  # GELU(-1e4) == 0: the third path adds nothing
        first_half = group.act(group.norm1(group.pool(group.conv1(x))))
        assert torch.allclose(group(x), first_half)
    plain = build_model("fastnet", 10)
    assert [g.conv2.out_channels for g in plain.groups] == [64, 256, 256]
    assert not any(hasattr(g, "conv3") for g in plain.groups)


def test_cutout_blanks_exactly_the_square() -> None:
    x = torch.randn(4, 3, 10, 10)
    top, left = torch.tensor([0, 2, 7, 4]), torch.tensor([0, 5, 7, 1])
    got = cutout(x.clone(), top, left, 3)
    for i in range(4):
        want = x[i].clone()
        want[:, top[i] : top[i] + 3, left[i] : left[i] + 3] = 0
        assert torch.equal(got[i], want)
    cl = x.clone().contiguous(memory_format=torch.channels_last)
    assert torch.equal(cutout(cl, top, left, 3), got)  # the training memory format gives the same pixels


def plan(**kw: object) -> BatchPlan:
    return BatchPlan(96, 32, seed=4, crop_padding=2, pad_mode="reflect", flip="alternate", image_size=8, **kw)


def test_cutout_is_a_function_of_seed_epoch_step_and_world_size_invariant() -> None:
    whole = plan(cutout=3)
    perm = whole.permutation(1)
    idx = perm[32:64]
    a = whole.global_augmentation(1, 1, idx)
    assert len(a) == 5 and all(
        torch.equal(u, v) for u, v in zip(a, plan(cutout=3).global_augmentation(1, 1, idx), strict=True)
    )
    assert int(a[3].min()) >= 0 and int(a[3].max()) <= 8 - 3 and int(a[4].max()) <= 8 - 3
    assert len(set(a[3].tolist())) > 1  # positions vary across the batch
    for other in (
        whole.global_augmentation(2, 1, idx),
        whole.global_augmentation(1, 2, idx),
        BatchPlan(96, 32, seed=5, crop_padding=2, flip="alternate", image_size=8, cutout=3).global_augmentation(
            1, 1, idx
        ),
    ):
        assert not (torch.equal(a[3], other[3]) and torch.equal(a[4], other[4]))
    # turning cutout on keeps every crop and flip of the run
    off = plan().global_augmentation(1, 1, idx)
    assert len(off) == 3 and all(torch.equal(u, v) for u, v in zip(a[:3], off, strict=True))
    ranks = [plan(cutout=3, rank=r, world_size=2) for r in range(2)]
    for step in range(whole.steps_per_epoch):
        one = whole.rank_step(perm, 1, step)[1]
        two = [r.rank_step(r.permutation(1), 1, step)[1] for r in ranks]
        for k in range(5):
            assert torch.equal(one[k], torch.cat([two[0][k], two[1][k]]))


def test_plan_refuses_a_square_larger_than_the_images() -> None:
    with pytest.raises(BadInput) as err:
        plan(cutout=9)
    assert "data.cutout" in str(err.value) and "\n" not in str(err.value)


def test_cutout_is_identical_for_the_tensor_and_the_file_loader(tmp_path: Path) -> None:
    files = write_folder(tmp_path / "imgs", {"a": 24, "b": 24}, size=8)
    labels = torch.tensor([0] * 24 + [1] * 24)
    decoded = torch.stack([decode_image(str(f)) for f in files])
    norm = Normalizer((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), torch.device("cpu"), channels_last=True)
    p = BatchPlan(
        48,
        16,
        seed=1,
        rank=1,
        world_size=2,
        micro_batch=4,
        crop_padding=2,
        pad_mode="reflect",
        flip="alternate",
        cutout=4,
        image_size=8,
    )
    tensor = TrainLoader(ImageSet(labels=labels, images=decoded), p, norm, torch.device("cpu"), True, 0, 8)
    per_file = TrainLoader(
        ImageSet(labels=labels, files=[str(f) for f in files]), p, norm, torch.device("cpu"), True, 0, 8
    )
    blanked = 0
    for epoch in (0, 1):
        for (s1, m1), (s2, m2) in zip(tensor.epoch(epoch, 1), per_file.epoch(epoch, 1), strict=True):
            assert s1 == s2 and len(m1) == 2
            for (x1, y1), (x2, y2) in zip(m1, m2, strict=True):
                assert torch.equal(x1, x2) and torch.equal(y1, y2)
                blanked += int((x1 == 0).all(dim=1).sum())
    assert blanked == 2 * 2 * 8 * 16  # 2 epochs x 2 steps x 8 images, each with its 4x4 square blanked


RECIPE = [
    "--config",
    "configs/fast93.yaml",
    "data.name=synthetic",
    "data.image_size=32",
    "model.width=8",
    "train.precision=bf16",  # as before fast93.yaml measured it (auto): the two runs compared never differ in it
    "data.synthetic_train_size=384",
    "data.synthetic_val_size=64",
    "train.batch_size=64",
    "train.micro_batch_size=16",
    "train.epochs=2",
    "optim.warmup_epochs=0.5",
    "checkpoint.every_steps=4",
    "checkpoint.every_epochs=1",
]
"""Also run, interrupted and resumed, by test_fast_recipe_resume.test_a_fast_recipe_resumes_bit_for_bit[fast93]."""


def test_cutout_changes_training_batches() -> None:
    """The switch is wired: the same plan with and without cutout yields different pixels, same labels."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(1, 256, (96, 3, 8, 8), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (96,), generator=g)
    norm = Normalizer((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), torch.device("cpu"), channels_last=False)

    def first_batch(p: BatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        loader = TrainLoader(ImageSet(labels=labels, images=images), p, norm, torch.device("cpu"), True, 0, 8)
        return next(iter(loader.epoch(0, 0)))[1][0]

    (x_on, y_on), (x_off, y_off) = first_batch(plan(cutout=3)), first_batch(plan())
    assert torch.equal(y_on, y_off)
    assert int((x_on == 0).all(dim=1).sum()) == 32 * 9  # mean 0: blanked pixels are exactly 0
    assert int((x_off == 0).all(dim=1).sum()) == 0  # images have no zero pixels of their own
    assert torch.equal(x_on[x_on != 0], x_off[x_on != 0])
