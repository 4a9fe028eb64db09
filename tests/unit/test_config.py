"""train.config: YAML + dotted overrides, one-line errors, the atomic resolved config."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.unit.test_seams import loaded_with, loads_torch
from torchlaunch import config as config_mod
from torchlaunch.base.rules import Bound, interval
from torchlaunch.config import ConfigError, RunConfig
from torchlaunch.exit_codes import BadInput

ONE_LINE = re.compile(r"^config error: (?P<key>[^\s:]+): (?P<what>.+) \((?P<fix>[^()]+)\)$")


def config_error(path: Path | None, overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_mod.load(path, overrides)
    return info.value


def assert_one_line(err: ConfigError, key: str, *words: str) -> None:
    text = str(err)
    assert "\n" not in text
    m = ONE_LINE.match(text)
    assert m, f"not `config error: <key>: <what> (<fix>)`: {text!r}"
    assert m["key"] == key == err.key
    for w in words:
        assert w in text, f"{w!r} missing from {text!r}"
    assert isinstance(err, BadInput)  # becomes exit code 2 in the worker and the launcher


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("optim.lr=0.2", "optim.lr", 0.2),
        ("train.epochs=3", "train.epochs", 3),
        ("data.download=true", "data.download", True),
        ("data.download=false", "data.download", False),
        ("run_dir=runs/a", "run_dir", "runs/a"),
        ("optim.betas=[0.8, 0.95]", "optim.betas", [0.8, 0.95]),
        ("data.root=", "data.root", ""),
        ("model.name=a=b", "model.name", "a=b"),  # only the first '=' separates key and value
    ],
)
def test_override_values_are_yaml_scalars(text: str, key: str, value: object) -> None:
    assert config_mod.parse_override(text) == (key, value)


def test_overrides_apply_on_top_of_the_yaml_file() -> None:
    cfg = config_mod.load(
        REPO / "configs/smoke.yaml", ["optim.lr=1e-3", "train.epochs=2", "data.synthetic_val_size=511", "run_dir=/x/y"]
    )
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads 1e-3 as text
    assert cfg.train.epochs == 2
    assert cfg.data.synthetic_val_size == 511
    assert cfg.run_dir == "/x/y"
    assert cfg.model.name == "simple_cnn"  # from the file, untouched
    assert cfg.train.batch_size == 128


def test_later_override_wins() -> None:
    cfg = config_mod.load(None, ["seed=1", "seed=7"])
    assert cfg.seed == 7


def test_unknown_key_suggests_the_near_one(tmp_path: Path) -> None:
    err = config_error(None, ["optim.lrr=0.1"])
    assert_one_line(err, "optim.lrr", "unknown key", "did you mean optim.lr?")
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochz: 3\n")
    assert_one_line(config_error(f, []), "train.epochz", "unknown key", "train.epochs")
    # an unknown section is reported at its own name
    assert_one_line(config_error(None, ["nothing.like.this=1"]), "nothing", "unknown key")


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("train.epochs=abc", "train.epochs", ("expected an integer", "'abc'")),
        ("train.epochs=1.5", "train.epochs", ("expected an integer",)),
        ("optim.lr=fast", "optim.lr", ("expected a number", "'fast'")),
        ("data.download=maybe", "data.download", ("expected true or false",)),
        ("optim.lr=true", "optim.lr", ("expected a number",)),
    ],
)
def test_wrong_type(override: str, key: str, words: tuple[str, ...]) -> None:
    assert_one_line(config_error(None, [override]), key, *words)


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("optim.lr=-0.1", "optim.lr", ("must be > 0", "-0.1", "positive learning rate")),
        ("optim.lr=0", "optim.lr", ("must be > 0",)),
        ("checkpoint.keep=1", "checkpoint.keep", ("must be >= 2",)),
        ("data.val_fraction=1.5", "data.val_fraction", ("between 0 and 1",)),
        ("train.batch_size=0", "train.batch_size", ("must be >= 1",)),
        (
            "model.name=vgg",
            "model.name",
            ("unknown value 'vgg'", "simple_cnn, resnet18, fastnet, fastnet93, torchvision.<name>"),
        ),
        ("model.name=torchvision.", "model.name", ("unknown value 'torchvision.'",)),
        ("model.width=16", "model.width", ("torchvision.resnet18 has a fixed width", "model.width=0")),
        ("data.name=mnist", "data.name", ("unknown value 'mnist'", "cifar10")),
        ("train.precision=fp8", "train.precision", ("fp8", "bf16")),
        ("preemption.signals=[SIGFOO]", "preemption.signals", ("SIGFOO",)),
        ("checkpoint.format=zarr", "checkpoint.format", ("unknown value 'zarr'", "single_file, dcp")),
    ],
)
def test_impossible_values(override: str, key: str, words: tuple[str, ...]) -> None:
    base = ["model.name=torchvision.resnet18"] if override.startswith("model.width") else []
    assert_one_line(config_error(None, [*base, override]), key, *words)


def test_torchvision_model_names_pass_validation() -> None:
    """Any torchvision.<name> passes here (no torch import); train.models checks the name itself."""
    assert config_mod.load(None, ["model.name=torchvision.resnet18"]).model.name == "torchvision.resnet18"
    assert config_mod.load(None, ["model.name=torchvision.vit_b_16"]).model.width == 0


def test_micro_batch_need_not_divide_the_batch() -> None:
    """A memory bound, not a divisor: 256 on 1 rank with at most 100 per pass is 3 micro-steps."""
    cfg = config_mod.load(None, ["train.batch_size=256", "train.micro_batch_size=100"])
    assert cfg.train.micro_batch_size == 100


def test_override_without_equals_sign() -> None:
    with pytest.raises(ConfigError) as info:
        config_mod.parse_override("optim.lr")
    assert_one_line(info.value, "optim.lr", "key=value")


def test_missing_config_file(tmp_path: Path) -> None:
    err = config_error(tmp_path / "nope.yaml", [])
    assert_one_line(err, "--config", "file not found", "nope.yaml")


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("seed: 1\ntrain:\n  epochs: [3\n  batch_size: 4\n")
    err = config_error(f, [])
    assert_one_line(err, "--config", "not valid YAML", str(f), "line ")


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    assert_one_line(config_error(f, []), "--config", "must hold a mapping", "list")


def test_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("data: 5\n")
    assert_one_line(config_error(f, []), "data", "expected a mapping")


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    f = tmp_path / "empty.yaml"
    f.write_text("")
    assert config_mod.load(f, []) == RunConfig()


def test_every_shipped_recipe_loads() -> None:
    for recipe in sorted((REPO / "configs").glob("*.yaml")):
        cfg = config_mod.load(recipe, [])
        assert cfg.run_dir and cfg.data.name in config_mod.CHOICES["data.name"], recipe


def test_write_resolved_round_trips(tmp_path: Path) -> None:
    cfg = config_mod.load(REPO / "configs/smoke.yaml", [f"run_dir={tmp_path / 'run'}", "optim.lr=0.05"])
    path = config_mod.write_resolved(cfg)
    assert path == tmp_path / "run" / "config.yaml"
    assert config_mod.load(path, []) == cfg  # what every rank reads is exactly what the launcher resolved
    assert config_mod.from_dict(yaml.safe_load(path.read_text())) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp file left behind


def test_write_resolved_is_stable(tmp_path: Path) -> None:
    """Rewriting an identical config leaves the file alone: ranks reading it never race a rewrite."""
    cfg = config_mod.load(None, [f"run_dir={tmp_path}"])
    path = config_mod.write_resolved(cfg)
    before = path.stat()
    assert config_mod.write_resolved(cfg) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert config_mod.dump(cfg) == config_mod.dump(config_mod.load(path, []))  # same text every time


def test_write_resolved_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while replacing keeps the old file whole and leaves no temp file."""
    old = config_mod.load(None, [f"run_dir={tmp_path}", "seed=1"])
    path = config_mod.write_resolved(old)
    old_text = path.read_text()

    def broken_replace(src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        with open(os.open(src, os.O_RDONLY, dir_fd=src_dir_fd)) as written:  # relative to the folder's descriptor
            assert written.read() == config_mod.dump(new)  # the full new text was written first
        raise OSError("disk vanished")

    new = config_mod.load(None, [f"run_dir={tmp_path}", "seed=2"])
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk vanished"):
        config_mod.write_resolved(new)
    monkeypatch.undo()
    assert path.read_text() == old_text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert config_mod.write_resolved(new).read_text() == config_mod.dump(new)


def test_all_keys_lists_nested_leaves() -> None:
    keys = config_mod.all_keys()
    for required in (
        "run_dir",
        "seed",
        "data.name",
        "data.root",
        "model.name",
        "train.epochs",
        "train.batch_size",
        "checkpoint.every_steps",
        "checkpoint.keep",
        "checkpoint.resume",
        "dist.timeout_s",
    ):
        assert required in keys
    assert "data" not in keys  # sections are not leaves


# ------------------------------------------------------------------- bounds and choices beside their fields

RULED_KEYS = {
    "checkpoint.every_epochs", "checkpoint.every_steps", "checkpoint.format", "checkpoint.keep", "data.crop_padding", "data.cutout",
    "data.decode", "data.flip", "data.image_size", "data.loader", "data.max_train_samples", "data.max_val_samples", "data.name",
    "data.num_workers", "data.pad_mode", "data.shard_label", "data.split_seed", "data.synthetic_classes", "data.synthetic_train_size",
    "data.synthetic_val_size", "data.train_crop", "data.val_fraction", "data.val_resize", "dist.backend", "dist.timeout_s", "model.name", "model.width",
    "optim.betas", "optim.lookahead_decay", "optim.lookahead_every", "optim.lr", "optim.min_lr_ratio",
    "optim.momentum", "optim.name", "optim.norm_lr_scale", "optim.schedule", "optim.step_epochs", "optim.step_gamma",
    "optim.warmup_epochs", "optim.warmup_start_ratio", "optim.weight_decay", "preemption.lead_time_s",
    "preemption.signals", "recovery.heartbeat_timeout_s", "recovery.lighthouse", "recovery.quorum_timeout_s", "recovery.rejoin", "seed", "train.batch_size", "train.clip_grad_norm", "train.epochs", "train.label_smoothing",
    "train.grid_micro_batches", "train.log_every_steps", "train.max_steps", "train.micro_batch_size", "train.precision", "train.tta",
}  # fmt: skip
"""Every key that is range- or choice-checked: a rule lost from a field fails here."""
CANDIDATES = [-1, -0.5, 0, 0.5, 1, 1.5, 2, 7, 1000, [0.9], [0.5, 1.0], ["SIGFOO"], "nope"]
"""Values tried against each rule: every rule rejects at least one of them."""


def leaf_fields(cls: type = RunConfig, prefix: str = "") -> dict[str, tuple[object, object]]:
    """Dotted key -> (field, type) of every leaf field."""
    import dataclasses
    import typing

    found: dict[str, tuple[object, object]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            found.update(leaf_fields(hints[f.name], prefix + f.name + "."))
        else:
            found[prefix + f.name] = (f, hints[f.name])
    return found


def test_every_rule_lives_in_its_fields_metadata() -> None:
    leaves = leaf_fields()
    rules = config_mod.rules()
    assert {key for key, _ in rules} == RULED_KEYS
    for key, rule in rules:
        field, _ = leaves[key]
        assert rule in field.metadata.values()  # the field owns it; rules() only reads it
    assert config_mod.CHOICES["model.name"] == ("simple_cnn", "resnet18", "fastnet", "fastnet93")
    assert "preemption.signals" in config_mod.CHOICES  # a list field: each item is checked


def test_every_number_field_has_a_bound() -> None:
    numbers = {key for key, (_, tp) in leaf_fields().items() if tp in (int, float)}
    bounded = {key for key, rule in config_mod.rules() if isinstance(rule, Bound)}
    assert numbers - bounded == set()


@pytest.mark.parametrize("key", sorted(RULED_KEYS))
def test_every_rule_rejects_with_one_line_through_config_error(key: str) -> None:
    """Each rule fails on some value with the one ConfigError form, the key named."""
    errors = []
    for value in CANDIDATES:
        try:
            config_mod.load(None, [f"{key}={value}"])
        except ConfigError as e:
            if e.key == key:
                errors.append(e)
    assert errors, f"no value of {CANDIDATES} is rejected for {key}"
    for err in errors:
        assert_one_line(err, key)


@pytest.mark.parametrize(
    ("ends", "inside", "outside"),
    [("[)", [0, 0.5], [1, -0.1]), ("[]", [0, 1], [1.1, -0.1]), ("(]", [0.5, 1], [0, 1.5])],
)
def test_interval_ends(ends: str, inside: list[float], outside: list[float]) -> None:
    rule = interval(0, 1, ends, "fix")["bound"]
    assert rule.requirement == f"must be in {ends[0]}0, 1{ends[1]}"
    assert all(rule.ok(v) for v in inside) and not any(rule.ok(v) for v in outside)


def test_every_config_message_is_raised_as_config_error() -> None:
    """No module spells `config error: ...` into a plain BadInput: ConfigError is the one path (its key
    is then known to callers such as the doctor, and the form cannot drift)."""
    import ast

    def text_start(node: ast.expr) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr) and node.values:
            return text_start(node.values[0])
        return ""

    offending = []
    for path in sorted((REPO / "torchlaunch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "BadInput"
                and node.args
                and text_start(node.args[0]).startswith("config error")
            ):
                offending.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offending == []
    assert config_mod.ConfigError is __import__("torchlaunch.exit_codes").exit_codes.ConfigError


def test_the_config_and_every_section_load_without_torch() -> None:
    """The launchers build and validate the whole config before any rank starts, without torch: each
    section lives beside its component (core/checkpoint/, live/, ...), so every module the
    config loads, and each of their packages (core/checkpoint/__init__.py too), is torch-free at load."""
    seen = loaded_with("torchlaunch.config")
    assert {"torchlaunch.core.checkpoint.section", "torchlaunch.live.section"} <= seen
    assert not [m for m in sorted(seen) if loads_torch(m)], "the config loads torch through these"
    assert not [m for m in seen if m.startswith("torchlaunch.worker.")], "the config loads the worker"
