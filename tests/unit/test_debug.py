"""train.debug: the model check's one-line messages, anomaly detection, the OOM advice."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from torchlaunch.exit_codes import BadInput
from torchlaunch.worker import debug


def cnn_for_32px(num_classes: int = 10) -> nn.Module:
    """A flatten+linear head sized for 32x32 inputs: the classic mismatch on other sizes."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 16 * 16, num_classes),
    )


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(4 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def test_matching_model_passes_and_leaves_state_alone() -> None:
    model = cnn_for_32px()
    model.train()
    bn = model[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    debug.check_model_io(model, (3, 32, 32), num_classes=10, device="cpu")
    assert model.training  # mode restored
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # BN running stats untouched
    assert int(bn.num_batches_tracked) == 0
    assert not model._forward_hooks and not model[5]._forward_pre_hooks  # hooks removed


def test_head_that_does_not_match_the_input_size_names_the_layer() -> None:
    model = cnn_for_32px()
    with pytest.raises(BadInput) as caught:
        debug.check_model_io(model, (3, 64, 64), num_classes=10, device="cpu")
    message = str(caught.value)
    assert "\n" not in message
    assert "layer '5' (Linear(in_features=2048, out_features=10, bias=True))" in message
    assert "expects input (*, 2048) but got (2, 8192)" in message
    assert "3x64x64 sample" in message and "data.image_size" in message


def test_wrong_input_channels_names_the_conv() -> None:
    with pytest.raises(BadInput, match=r"layer 'features.0' \(Conv2d.*expects input \(N, 3, \*, \*\)"):
        debug.check_model_io(Named(), (1, 32, 32), num_classes=10, device="cpu")


def test_hooks_are_removed_after_a_failure() -> None:
    model = Named()
    with pytest.raises(BadInput):
        debug.check_model_io(model, (1, 32, 32), num_classes=10, device="cpu")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_wrong_number_of_classes() -> None:
    with pytest.raises(BadInput) as caught:
        debug.check_model_io(cnn_for_32px(num_classes=100), (3, 32, 32), 10, "cpu")
    assert "output is (2, 100)" in str(caught.value) and "num_classes=10" in str(caught.value)


class HalfMoved(nn.Module):
    """A layer whose parameters live on the meta device while the input is on the CPU: the same
    failure path as a layer left on the CPU while the input is on cuda:0 (no GPU here)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 10, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x).mean(dim=(2, 3)))


def test_device_mismatch_names_layer_and_devices() -> None:
    with pytest.raises(BadInput) as caught:
        debug.check_model_io(HalfMoved(), (3, 8, 8), 10, "cpu")
    message = str(caught.value)
    assert "layer 'head'" in message
    assert "parameters on meta but its input is on cpu" in message
    assert "model.to(device)" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_layer_with_cuda_input_names_the_layer() -> None:
    model = Named().cuda()
    model.head = nn.Linear(16, 10)  # created after .cuda(): left on the CPU
    with pytest.raises(BadInput, match=r"layer 'head'.*parameters on cpu but its input is on cuda:0"):
        debug.check_model_io(model, (3, 32, 32), 10, "cuda:0")


def test_anomaly_detection_off_is_silent_and_on_warns_and_catches_nan() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with debug.anomaly_detection(False):
            assert not torch.is_anomaly_enabled()
    x = torch.tensor([0.0], requires_grad=True)
    with (
        pytest.warns(RuntimeWarning, match="several times slower"),
        pytest.raises(RuntimeError, match="returned nan values"),
        debug.anomaly_detection(True),
    ):
        (x / x).sum().backward()
    assert not torch.is_anomaly_enabled()


def test_is_oom() -> None:
    assert debug.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert debug.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not debug.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not debug.is_oom(ValueError("out of memory"))


def test_describe_oom_names_the_config_keys_and_keeps_the_global_batch() -> None:
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)")
    text = debug.describe_oom(
        exc,
        device="cuda:0",
        batch_size=1024,
        micro_batch_size=0,
        world_size=4,
        precision="fp32",
        channels_last=False,
        last_checkpoint="runs/a/checkpoints/step-000000400",
    )
    assert text.startswith("out of memory on cuda:0: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "256 images per rank" in text
    assert "train.micro_batch_size=128 (train.batch_size=1024 unchanged, 2 micro-batches" in text
    assert "train.precision=bf16" in text and "train.channels_last=true" in text
    assert "last good checkpoint is kept (runs/a/checkpoints/step-000000400)" in text
    assert "memory summary" in text.lower()


def test_describe_oom_when_options_are_already_used() -> None:
    text = debug.describe_oom(
        RuntimeError("CUDA out of memory"),
        batch_size=96,
        micro_batch_size=1,
        world_size=96,
        precision="bf16",
        channels_last=True,
    )
    assert "bf16 is already on" in text and "channels_last is already on" in text
    assert "lower train.micro_batch_size" in text


def test_smaller_micro_batch_halves_the_pass() -> None:
    assert debug._smaller_micro_batch(960, 120, 8) == 60
    assert debug._smaller_micro_batch(6 * 3, 6, 3) == 3
    assert debug._smaller_micro_batch(10, 5, 2) == 2  # need not divide: shares of 5 run as 2 passes of 3 and 2
    assert debug._smaller_micro_batch(8, 1, 8) is None
