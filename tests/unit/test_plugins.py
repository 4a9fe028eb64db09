"""test_plugins: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_plugins_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_plugins_runs import DATA, MODEL
from torchlaunch import config as config_mod
from torchlaunch.config import ConfigError
from torchlaunch.exit_codes import BadInput
from torchlaunch.worker import init_from
from torchlaunch.worker.data import load_bundle


def test_both_loader_paths_decode_a_plugin_dataset_identically() -> None:
    """PIL images (train) and float tensors (val) become the same uint8 images on the in-memory path
    and on the per-sample path, with the same labels and normalisation."""
    common = [DATA, "data.max_train_samples=40", "data.max_val_samples=30"]
    memory = load_bundle(config_mod.load("configs/smoke.yaml", [*common, "data.loader=tensor"]).data)
    per_sample = load_bundle(config_mod.load("configs/smoke.yaml", [*common, "data.loader=pil"]).data)
    assert memory.train.images is not None and per_sample.train.images is None
    assert len(memory.train) == 40 and len(per_sample.val) == 30
    for mem, lazy in ((memory.train, per_sample.train), (memory.val, per_sample.val)):
        assert torch.equal(mem.labels, lazy.labels)
        for i in (0, 7, len(mem) - 1):
            assert torch.equal(mem.images[i], lazy.decode(i, 32))
    assert memory.classes == per_sample.classes == ["red", "green", "blue", "yellow"]


@pytest.mark.parametrize(
    "content,expected",
    [
        (b"not a torch file", "cannot load"),
        (None, "holds a list, not a state_dict of tensors"),
    ],
)
def test_init_from_bad_file_is_one_line(tmp_path: Path, content: bytes | None, expected: str) -> None:
    from examples.my_models import tiny_cnn

    path = tmp_path / "weights.pt"
    if content is None:
        torch.save([1, 2, 3], path)
    else:
        path.write_bytes(content)
    with pytest.raises(BadInput) as caught:
        init_from.apply(tiny_cnn(num_classes=4), str(path), strict=True)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("config error: model.init_from:") and expected in message


def test_config_checks_import_path_syntax_without_importing() -> None:
    cfg = config_mod.load("configs/smoke.yaml", [MODEL, DATA, "model.init_from=runs/a"])
    assert cfg.model.name == "examples.my_models:tiny_cnn" and cfg.model.init_strict is True
    for bad in ("model.name=pkg.mod:fac-tory", "data.name=pkg..mod:f", "data.name=pkg.mod:1abc"):
        with pytest.raises(ConfigError) as caught:
            config_mod.load("configs/smoke.yaml", [bad])
        assert "is not an import path" in str(caught.value) and "pkg.module:factory" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        config_mod.load("configs/smoke.yaml", ["data.name=nope"])
    assert "pkg.module:factory" in str(caught.value)  # the choices name the plug-in form too


def test_init_from_comes_after_fastnet_data_init_and_only_on_a_fresh_run(tmp_path: Path, capsys) -> None:
    """fastnet sets its stem from the training images at construction; init_from must win over that (it
    is applied after), and a run folder with its own checkpoint ignores init_from and says so."""
    from torchlaunch.core.dist import DistContext
    from torchlaunch.core.preemption import PreemptionWatcher
    from torchlaunch.worker.models import FastNet
    from torchlaunch.worker.trainer import Trainer

    source = FastNet(num_classes=10, width=8)
    with torch.no_grad():
        for value in source.state_dict().values():
            if value.is_floating_point():
                value.add_(0.5)  # nothing like a fresh or data-initialised net
    weights = tmp_path / "weights.pt"
    torch.save(source.state_dict(), weights)
    overrides = [
        "data.synthetic_train_size=256",
        "data.synthetic_val_size=64",
        "train.batch_size=64",
        "model.name=fastnet",
        "model.width=8",
        f"model.init_from={weights}",
        f"run_dir={tmp_path / 'run'}",
    ]
    cfg = config_mod.load("configs/smoke.yaml", overrides)
    bundle = load_bundle(cfg.data)
    trainer = Trainer(cfg, DistContext(), bundle, PreemptionWatcher([]))
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, source.state_dict()[key]), key  # the stem too: not the whitening filters
    assert "loaded all" in capsys.readouterr().out
    from torchlaunch.core import checkpoint as ckpt

    # the run's own checkpoint: one that verifies (a bare marker is not a checkpoint to resume from)
    ckpt.write_checkpoint(tmp_path / "run" / "checkpoints", 1, {"format_version": ckpt.FORMAT_VERSION}, {})
    resumed = Trainer(cfg, DistContext(), bundle, PreemptionWatcher([]))
    assert "ignored: resuming from this run's own checkpoint" in capsys.readouterr().out
    stem = resumed.model.state_dict()["stem.0.weight"]
    assert not torch.equal(stem, source.state_dict()["stem.0.weight"])


HOSTILE_DATA = """
import plugin_gate
import torch

class Split:
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return torch.zeros(3, 4, 4, dtype=torch.uint8), 0

def hangs():
    plugin_gate.GATE.wait(60)

def exits():
    raise SystemExit(3)

def huge():
    return Split(10**12), Split(4), ["a", "b"]

def negative():
    return Split(-1), Split(4), ["a", "b"]

def many_classes():
    return Split(4), Split(4), [str(i) for i in range(10**6)]

def model_exits(num_classes):
    raise SystemExit(3)
"""


@pytest.mark.parametrize(
    ("factory", "said"),
    [
        ("hangs", "factory 'hostile_data:hangs' did not return within 0.3 s"),
        ("exits", "factory 'hostile_data:exits' raised SystemExit: 3"),
        ("huge", "the train split says it has 1000000000000 samples, more than 1000000000"),
        ("negative", "len() of the train split raised ValueError: __len__() should return >= 0"),
        ("many_classes", "1000000 classes, more than 131072"),
    ],
)
def test_a_data_factory_that_hangs_exits_or_claims_too_much_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, factory: str, said: str
) -> None:
    """Issue 52: a factory that hung was never bounded (the hang watchdog arms after the first step), a
    `__len__` of 10**12 was silent for 120 s and a million classes died after 112 s with a traceback.
    Each is now a config error (exit 2, one line) before anything is allocated, within the bound."""
    import sys
    import threading
    import time
    import types

    from torchlaunch.worker import plugins

    (tmp_path / "hostile_data.py").write_text(HOSTILE_DATA)
    gate = types.SimpleNamespace(GATE=threading.Event())
    monkeypatch.setitem(sys.modules, "plugin_gate", gate)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hostile_data", raising=False)
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError) as refused:
            plugins.load_data(f"hostile_data:{factory}", str(tmp_path), 32, timeout_s=0.3 if factory == "hangs" else 60)
    finally:
        gate.GATE.set()
    assert time.monotonic() - start < 30
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert isinstance(refused.value, BadInput)


def test_a_model_factory_that_raises_system_exit_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plug-in's SystemExit must not end the worker with its code and no word (issue 52's `status` exit 3)."""
    import sys
    import types

    from torchlaunch.worker import plugins

    (tmp_path / "hostile_data.py").write_text(HOSTILE_DATA)
    monkeypatch.setitem(sys.modules, "plugin_gate", types.SimpleNamespace())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hostile_data", raising=False)
    with pytest.raises(ConfigError, match=r"factory 'hostile_data:model_exits' raised SystemExit: 3 when called"):
        plugins.build_model("hostile_data:model_exits", 10)
