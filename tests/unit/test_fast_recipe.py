"""The time-to-accuracy parts (configs/fast.yaml): whitening stem, shift-only BatchNorm, BatchNorm LR
scale, triangular schedule, alternating flips with reflect-padded crops, lookahead averaging, TTA."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from torchlaunch import config
from torchlaunch.worker.data import BatchPlan, augment
from torchlaunch.worker.lookahead import Lookahead
from torchlaunch.worker.models import build_model, patch_matrix
from torchlaunch.worker.optim import lr_lambda_factory, param_groups
from torchlaunch.worker.tta import tta_logits


def test_fastnet_stem_whitens_patches_and_is_frozen() -> None:
    torch.manual_seed(0)
    base = torch.randn(64, 3, 16, 16)
    images = base + 0.8 * base.roll(1, dims=1) + 0.5 * base.roll(1, dims=3)  # correlated channels and pixels
    model = build_model("fastnet", 10)
    model.init_from_data(images, eps=0.0)
    conv = model.stem[0]
    out = nn.functional.conv2d(images, conv.weight[:12])  # the 12 positive filters, no bias
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12).double()
    cov = flat.T @ flat / flat.shape[0]
    assert torch.allclose(cov, torch.eye(12, dtype=torch.float64), atol=1e-3), cov.diag()
    assert torch.equal(conv.weight[12:], -conv.weight[:12])
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert "stem.0.weight" in frozen and "groups.0.norm1.weight" in frozen and "stem.0.bias" not in frozen


@pytest.mark.parametrize("shape", [(5, 3, 8, 8), (2, 3, 7, 9), (3, 1, 4, 5)])
def test_patch_matrix_is_the_unfolded_patches_bit_for_bit(shape: tuple[int, int, int, int]) -> None:
    """The whitening init must keep its numbers: its covariance matmul gets the same values in the same layout."""
    images = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    reference = images.unfold(2, 2, 1).unfold(3, 2, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, shape[1] * 4)
    ours = patch_matrix(images, 2, 2)
    assert ours.dtype == torch.float32 and ours.stride() == reference.stride() == (shape[1] * 4, 1)
    assert torch.equal(ours, reference)
    assert torch.equal(
        patch_matrix(images.to(torch.bfloat16), 3, 2),
        images.to(torch.bfloat16)
        .float()
        .unfold(2, 3, 1)
        .unfold(3, 2, 1)
        .permute(0, 2, 3, 1, 4, 5)
        .reshape(-1, shape[1] * 6),
    )


def test_norm_lr_scale_keeps_decay_per_step() -> None:
    cfg = config.load(None, ["model.name=fastnet", "optim.lr=2", "optim.weight_decay=0.01", "optim.norm_lr_scale=64"])
    model = build_model("fastnet", 10)
    groups = param_groups(cfg, model)
    assert [g["lr"] for g in groups] == [2, 128]
    assert math.isclose(groups[1]["lr"] * groups[1]["weight_decay"], groups[0]["lr"] * groups[0]["weight_decay"])
    norms = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters() if p.requires_grad}
    assert {id(p) for p in groups[1]["params"]} == norms
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(p.numel() for g in groups for p in g["params"]) == trainable
    single = param_groups(config.load(None, ["model.name=fastnet"]), model)
    assert len(single) == 1


def test_triangular_schedule() -> None:
    cfg = config.load(
        None,
        ["optim.schedule=linear", "optim.warmup_epochs=2", "optim.warmup_start_ratio=0.2", "optim.min_lr_ratio=0.07"],
    )
    factor = lr_lambda_factory(cfg, steps_per_epoch=10, total_steps=100)
    assert factor(0) == pytest.approx(0.2) and factor(10) == pytest.approx(0.6) and factor(20) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(1 - 0.93 * 0.5) and factor(100) == pytest.approx(0.07)
    plain = lr_lambda_factory(config.load(None, ["optim.warmup_epochs=1"]), 10, 100)
    assert plain(0) == pytest.approx(0.1)  # the default warmup is unchanged: (step + 1) / warmup


def test_alternating_flip_is_per_sample_and_world_size_invariant() -> None:
    plan = BatchPlan(96, 32, seed=4, flip="alternate")
    perm0, perm1 = plan.permutation(0), plan.permutation(1)
    flips = [{}, {}]
    for epoch, perm in enumerate((perm0, perm1)):
        for step in range(plan.steps_per_epoch):
            idx, (_, _, flip) = plan.rank_step(perm, epoch, step)
            flips[epoch].update(zip(idx.tolist(), flip.tolist(), strict=True))
    assert all(flips[0][i] != flips[1][i] for i in range(96))  # every image is seen both ways
    assert 30 < sum(flips[0].values()) < 66
    ranks = [BatchPlan(96, 32, seed=4, rank=r, world_size=2, flip="alternate") for r in range(2)]
    for step in range(3):
        whole = plan.rank_step(perm1, 1, step)[1][2]
        parts = torch.cat([r.rank_step(r.permutation(1), 1, step)[1][2] for r in ranks])
        assert torch.equal(whole, parts)
    none = BatchPlan(96, 32, seed=4, flip="none")
    assert not none.rank_step(perm0, 0, 0)[1][2].any()


def test_reflect_padded_crop_matches_pad_then_slice() -> None:
    images = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8)
    dy, dx = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([4, 0, 2, 1, 3])
    flip = torch.tensor([False, True, False, True, True])
    got = augment(images, dy, dx, flip, padding=2, pad_mode="reflect")
    padded = nn.functional.pad(images, (2, 2, 2, 2), mode="reflect")
    for i in range(5):
        want = padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8]
        assert torch.equal(got[i], want.flip(-1) if flip[i] else want)


def test_lookahead_pulls_toward_the_average_and_ends_on_it() -> None:
    model = nn.Linear(3, 2)
    la = Lookahead(model, every=2, decay=0.8, total_steps=4)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    la.after_step(1)  # not a multiple of `every`: nothing happens
    assert torch.equal(model.weight, start + 1)
    la.after_step(2)  # keep = 0.8 * (2/4)^3 = 0.1
    want = start + 0.9
    assert torch.allclose(model.weight, want) and torch.allclose(la.average["weight"], want)
    with torch.no_grad():
        model.weight.add_(5.0)
    la.after_step(4)  # the end: the model becomes the average, which does not move
    assert torch.allclose(model.weight, want)
    restored = Lookahead(nn.Linear(3, 2), every=2, decay=0.8, total_steps=4)
    restored.load_state_dict(la.state_dict())
    assert torch.equal(restored.average["weight"], la.average["weight"])


def test_tta_levels() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.Flatten(), nn.LazyLinear(2))
    model(x)
    plain = model(x)
    assert torch.equal(tta_logits(model, x, "none"), plain)
    assert torch.allclose(tta_logits(model, x, "flip"), 0.5 * plain + 0.5 * model(x.flip(-1)))
    symmetric = lambda t: t.mean(dim=(1, 2, 3))[:, None].expand(-1, 2)  # noqa: E731 - invariant to flips
    assert torch.allclose(tta_logits(symmetric, x, "flip"), symmetric(x))
    full = tta_logits(model, x, "flip_translate")
    assert full.shape == plain.shape and not torch.allclose(full, tta_logits(model, x, "flip"))


def test_new_keys_reject_bad_values_in_one_line() -> None:
    for override, key in (
        ("data.flip=sometimes", "data.flip"),
        ("data.pad_mode=edge", "data.pad_mode"),
        ("train.tta=crop", "train.tta"),
        ("optim.norm_lr_scale=0", "optim.norm_lr_scale"),
        ("optim.lookahead_decay=1", "optim.lookahead_decay"),
        ("optim.schedule=cos", "optim.schedule"),
    ):
        with pytest.raises(config.ConfigError) as err:
            config.load(None, [override])
        assert str(err.value).startswith(f"config error: {key}:") and "\n" not in str(err.value)


RECIPE = [
    "--config",
    "configs/smoke.yaml",
    "model.name=fastnet",
    "model.width=8",
    "train.precision=bf16",
    "data.synthetic_train_size=512",
    "data.synthetic_val_size=64",
    "train.batch_size=64",
    "train.epochs=2",
    "data.crop_padding=2",
    "data.pad_mode=reflect",
    "data.flip=alternate",
    "optim.lr=0.2",
    "optim.norm_lr_scale=16",
    "optim.schedule=linear",
    "optim.warmup_start_ratio=0.2",
    "optim.lookahead_every=3",
    "train.tta=flip_translate",
    "checkpoint.every_steps=5",
    "train.label_smoothing=0.2",
]


def test_whitening_sample_decodes_files_of_any_size_at_the_training_size(tmp_path: Path) -> None:
    from tests.unit.test_data import write_folder
    from torchlaunch.worker.data import ImageSet, Normalizer
    from torchlaunch.worker.trainer import whitening_sample

    files = write_folder(tmp_path / "a", {"x": 2}, size=40) + write_folder(tmp_path / "b", {"y": 2}, size=24)
    images = ImageSet(labels=torch.zeros(4, dtype=torch.long), files=[str(f) for f in files])
    normalize = Normalizer((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), torch.device("cpu"), channels_last=False)
    sample = whitening_sample(images, normalize, image_size=32)
    assert sample.shape == (4, 3, 32, 32) and sample.dtype == torch.float32
    model = build_model("fastnet", 10)
    model.init_from_data(sample)
    assert torch.isfinite(model.stem[0].weight).all()
