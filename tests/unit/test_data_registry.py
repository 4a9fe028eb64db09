"""The data-format registry (torchlaunch.data.registry): one entry per format answers the reader, the
launchers' pre-check, evaluation's data set and the GPU-decode rule; the launch side reads it without
importing torch or the built-in worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from torchlaunch import config as config_mod
from torchlaunch.backends.local import launch as local
from torchlaunch.data import registry
from torchlaunch.exit_codes import BAD_INPUT, BadInput, ConfigError
from torchlaunch.launch import precheck
from torchlaunch.worker.data import DataBundle, ImageSet, load_bundle
from torchlaunch.worker.evaluate import load_eval_set, parse_args

FAKE = "fakefmt"


class FakeFormat:
    """Records which of its entry's functions were called, with what."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.missing = False

    def load(self, cfg: config_mod.DataConfig) -> DataBundle:
        self.calls.append(("load", cfg.root))
        train = ImageSet(labels=torch.arange(6) % 2, images=torch.full((6, 3, 8, 8), 7, dtype=torch.uint8))
        val = ImageSet(labels=torch.arange(4) % 2, images=torch.full((4, 3, 8, 8), 9, dtype=torch.uint8))
        return DataBundle(train, val, ["a", "b"], (0.5,) * 3, (0.25,) * 3, 8)

    def precheck(self, cfg: config_mod.DataConfig, local: bool) -> None:
        self.calls.append(("precheck", local))
        if self.missing:
            raise BadInput(f"data error: no fake set under {cfg.root} (make one)")

    def eval_set(self, cfg: config_mod.DataConfig, split: str) -> tuple[ImageSet, list[str]]:
        self.calls.append(("eval_set", (cfg.root, split)))
        return ImageSet(
            labels=torch.zeros(5, dtype=torch.int64), images=torch.zeros((5, 3, 8, 8), dtype=torch.uint8)
        ), [
            "a",
            "b",
        ]


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeFormat]:
    entry = FakeFormat()
    registry.register(
        registry.DataFormat(
            name=FAKE,
            load=entry.load,
            precheck=entry.precheck,
            eval_set=entry.eval_set,
            detect=lambda root: (root / "FAKE").is_file(),
            held_out=("all", "val"),
        )
    )
    try:
        yield entry
    finally:
        registry.unregister(FAKE)


def test_a_registered_format_feeds_training_the_precheck_and_evaluation(fake: FakeFormat, tmp_path: Path) -> None:
    cfg = config_mod.load(None, [f"data.name={FAKE}", f"data.root={tmp_path}", "data.max_val_samples=3"])
    bundle = load_bundle(cfg.data)  # the rank's reader
    assert ("load", str(tmp_path)) in fake.calls
    assert len(bundle.train) == 6 and len(bundle.val) == 3  # the registry's reader, truncated as every format is
    precheck.check(cfg, on_cpu=True, local=True)  # the launchers' pre-spawn check
    assert ("precheck", True) in fake.calls
    fake.missing = True
    with pytest.raises(BadInput, match="no fake set under"):
        precheck.check(cfg, on_cpu=True, local=True)
    images, classes = load_eval_set(config_mod.to_dict(cfg), None, "auto", "val")  # the run's recorded root
    assert ("eval_set", (str(tmp_path), "val")) in fake.calls
    assert len(images) == 3 and classes == ["a", "b"]  # data.max_val_samples applies to --split val


def test_evaluation_detects_a_registered_format_and_offers_it_as_data_name(fake: FakeFormat, tmp_path: Path) -> None:
    (tmp_path / "FAKE").write_text("x")
    trained = config_mod.to_dict(config_mod.load(None, []))  # a synthetic run: --data-root names the folder
    images, _ = load_eval_set(trained, str(tmp_path), "auto", "all")
    assert ("eval_set", (str(tmp_path), "all")) in fake.calls and len(images) == 5
    assert parse_args(["--run-dir", "r", "--data-name", FAKE]).data_name == FAKE


def test_an_unknown_data_name_is_bad_input_listing_the_registered_formats(fake: FakeFormat) -> None:
    with pytest.raises(ConfigError) as caught:
        config_mod.load(None, ["data.name=nosuch"])
    message = str(caught.value)
    assert "'nosuch'" in message and all(n in message for n in ("cifar10", "imagefolder", "shards", FAKE))
    with pytest.raises(BadInput, match=f"unknown value 'nosuch'.*{FAKE}"):
        registry.get("nosuch")  # a direct caller (an unvalidated config) gets the same exit-2 line


def test_the_launcher_asks_the_registry_and_refuses_in_one_line_with_exit_2(
    fake: FakeFormat, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real launcher in-process (--dry-run spawns nothing): its pre-check runs the fake format's
    entry, and an unknown data.name is exit 2 with one line naming the registered formats."""
    smoke = ["--device", "cpu", "--config", str(REPO / "configs" / "smoke.yaml"), "--dry-run", f"run_dir={tmp_path}"]
    fake.missing = True
    assert local.main([*smoke, f"data.name={FAKE}", f"data.root={tmp_path}"]) == BAD_INPUT
    assert capsys.readouterr().err.splitlines() == [f"data error: no fake set under {tmp_path} (make one)"]
    assert local.main([*smoke, "data.name=nosuch"]) == BAD_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert "data.name: unknown value 'nosuch'" in line and f"shards, synthetic, {FAKE}, pkg.module:factory" in line


def test_gpu_decode_is_the_formats_capability(fake: FakeFormat) -> None:
    assert registry.names(gpu_decode=True) == ("imagefolder", "shards")
    resized = ["data.decode=gpu", "data.train_crop=resized", "data.root=d"]
    assert config_mod.load(None, ["data.name=shards", *resized]).data.decode == "gpu"
    with pytest.raises(ConfigError, match="data.decode: gpu decodes the JPEGs of data.name=imagefolder or shards"):
        config_mod.load(None, [f"data.name={FAKE}", *resized])


def test_the_built_in_formats_are_registered_once_each() -> None:
    assert registry.names() == ("cifar10", "imagefolder", "shards", "synthetic")
    assert registry.get("pkg.mod:factory").own_val  # every import path is the plug-in format
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("shards"))
