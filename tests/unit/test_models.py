"""train.models: every registered model maps 32x32 images to one logit per class."""

from __future__ import annotations

import pytest
import torch

from torchlaunch.exit_codes import BadInput
from torchlaunch.worker.models import REGISTRY, build_model


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("classes", [10, 7])
def test_output_shape(name: str, classes: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, classes).eval()
    with torch.no_grad():
        out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, classes)
    assert torch.isfinite(out).all()


def test_registry_has_the_four_models() -> None:
    assert set(REGISTRY) == {"simple_cnn", "resnet18", "fastnet", "fastnet93"}


def param_count(name: str, width: int = 0) -> int:
    return sum(p.numel() for p in build_model(name, 10, width).parameters())


def test_parameter_counts_are_sane() -> None:
    assert 11_000_000 < param_count("resnet18") < 11_400_000  # torchvision ResNet-18 with a 10-way head
    fast = param_count("fastnet")
    assert 500_000 < fast < 5_000_000, fast  # airbench-sized: far smaller than ResNet-18
    assert param_count("fastnet", 32) < fast / 3  # width scales it
    assert 50_000 < param_count("simple_cnn") < 500_000
    assert param_count("simple_cnn", 16) < param_count("simple_cnn")


@pytest.mark.parametrize("seed", [0, 3])
def test_resnet18_is_the_torchvision_built_model_bit_for_bit(seed: int) -> None:
    """The native resnet18 replaced torchvision's resnet18 with a swapped stem: old checkpoints must load into
    it and a seeded fresh run must start from the very same weights (exact-resume and reproducibility)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(seed)
    ours = build_model("resnet18", 10)
    rng_ours = torch.get_rng_state()
    torch.manual_seed(seed)
    theirs = torchvision.models.resnet18(num_classes=10)
    theirs.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    theirs.maxpool = torch.nn.Identity()
    assert torch.equal(rng_ours, torch.get_rng_state())  # later draws of the run continue identically
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    for key in b:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key
    # the optimizer's state is saved by parameter position: the order must match too
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    x = torch.randn(4, 3, 32, 32)
    assert torch.equal(ours(x), theirs(x))  # train mode: batch statistics, running stats updated
    assert all(torch.equal(a[k], b[k]) for k in b)
    fresh = build_model("resnet18", 10)
    fresh.load_state_dict(theirs.state_dict(), strict=True)


def test_resnet18_has_the_cifar_stem() -> None:
    model = build_model("resnet18", 10)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)


def test_fastnet_trains_in_bf16_channels_last_on_cpu() -> None:
    """The real-data test's mode: one backward pass must work and move the weights."""
    torch.manual_seed(0)
    model = build_model("fastnet", 10).to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    before = model.head.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), torch.arange(8) % 10)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, model.head.weight)


def test_unknown_model_and_fixed_width() -> None:
    with pytest.raises(BadInput, match=r"model.name: unknown model 'vgg' \(choose one of"):
        build_model("vgg", 10)
    with pytest.raises(BadInput, match="resnet18 has a fixed width"):
        build_model("resnet18", 10, 32)


def test_torchvision_model_by_name_is_the_stock_architecture() -> None:
    torch.manual_seed(0)
    model = build_model("torchvision.resnet18", 7).eval()
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)  # ImageNet stem, untouched
    assert isinstance(model.maxpool, torch.nn.MaxPool2d)
    with torch.no_grad():
        out = model(torch.randn(4, 3, 32, 32))
    assert out.shape == (4, 7) and torch.isfinite(out).all()


def test_unknown_torchvision_model_is_one_config_line() -> None:
    with pytest.raises(BadInput) as info:
        build_model("torchvision.resnet19", 10)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(
        "config error: model.name: unknown torchvision classification model "
        "'torchvision.resnet19' (did you mean torchvision.resnet18?"
    )
    assert "torchvision.models.list_models" in text
    with pytest.raises(BadInput, match=r"^config error: model.width: torchvision.resnet18 has a fixed width"):
        build_model("torchvision.resnet18", 10, 32)
