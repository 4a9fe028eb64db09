"""The data-format registry (torchlaunch.data.registry): one entry per format answers the reader, the
launchers' pre-check, evaluation's data set and the GPU-decode rule; the launch side reads it without
importing torch or the built-in worker."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from torchlaunch import config as config_mod
from torchlaunch import config_help
from torchlaunch.agent import node
from torchlaunch.base.rules import at_least
from torchlaunch.data import registry, section
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
    assert node.main([*smoke, f"data.name={FAKE}", f"data.root={tmp_path}"]) == BAD_INPUT
    assert capsys.readouterr().err.splitlines() == [f"data error: no fake set under {tmp_path} (make one)"]
    assert node.main([*smoke, "data.name=nosuch"]) == BAD_INPUT
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


@dataclasses.dataclass
class FakeOptions:
    """fakefmt's own keys."""

    fake_depth: int = dataclasses.field(default=3, metadata=at_least(1, 10, "e.g. data.fake_depth=3"))
    """fakefmt only: how deep the fake set nests."""


def test_a_format_brings_its_own_config_section_flat_under_data(fake: FakeFormat) -> None:
    """A format's section (DataFormat.options) joins the data section at the next load: its key parses,
    is bounded by its own rule, is listed by --help-config, and leaves with the format."""
    entry = registry.get(FAKE)
    registry.unregister(FAKE)
    registry.register(dataclasses.replace(entry, options=FakeOptions))
    try:
        cfg = config_mod.load(None, [f"data.name={FAKE}", "data.root=d", "data.fake_depth=7"])
        assert cfg.data.fake_depth == 7 and cfg.data.download is False  # its key beside the built-ins' keys
        assert config_mod.from_dict(config_mod.to_dict(cfg)).data.fake_depth == 7  # the resolved file reads back
        with pytest.raises(ConfigError, match=r"^config error: data.fake_depth: must be at most 10"):
            config_mod.load(None, ["data.fake_depth=11"])
        (line,) = [row for row in config_help.help_config().splitlines() if row.startswith("data.fake_depth=3 ")]
        assert line.endswith("# fakefmt only: how deep the fake set nests."), line
    finally:
        registry.unregister(FAKE)
        registry.register(entry)
    with pytest.raises(ConfigError, match="data.fake_depth: unknown key"):
        config_mod.load(None, ["data.fake_depth=7"])


def test_a_key_two_sections_define_is_refused() -> None:
    """data.download belongs to cifar10's section: a second owner is refused when the section composes."""

    @dataclasses.dataclass
    class Clash:
        download: bool = True

    with pytest.raises(ValueError, match="data.download of Clash is already a key of Cifar10Options"):
        section.compose((*registry.options(), Clash))


def test_config_knows_no_format_by_name() -> None:
    """The formats' names and keys live in their own modules (torchlaunch/data/formats/): the config
    module spells none of them."""
    text = (REPO / "torchlaunch" / "config.py").read_text()
    for word in ("cifar10", "imagefolder", "synthetic", "shard_label", "download", "val_fraction"):
        assert word not in text, word
