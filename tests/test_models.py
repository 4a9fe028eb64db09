"""train.models: every registered model maps 32x32 images to one logit per class."""

from __future__ import annotations

import pytest
import torch

from train.exit_codes import BadInput
from train.models import REGISTRY, build_model


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("classes", [10, 7])
def test_output_shape(name: str, classes: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, classes).eval()
    with torch.no_grad():
        out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, classes)
    assert torch.isfinite(out).all()


def test_registry_has_the_three_models() -> None:
    assert set(REGISTRY) == {"simple_cnn", "resnet18", "fastnet"}


def param_count(name: str, width: int = 0) -> int:
    return sum(p.numel() for p in build_model(name, 10, width).parameters())


def test_parameter_counts_are_sane() -> None:
    assert 11_000_000 < param_count("resnet18") < 11_400_000  # torchvision ResNet-18 with a 10-way head
    fast = param_count("fastnet")
    assert 500_000 < fast < 5_000_000, fast  # airbench-sized: far smaller than ResNet-18
    assert param_count("fastnet", 32) < fast / 3  # width scales it
    assert 50_000 < param_count("simple_cnn") < 500_000
    assert param_count("simple_cnn", 16) < param_count("simple_cnn")


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
