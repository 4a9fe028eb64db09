"""Every number of the config has bounds a real machine can meet, and the config parsers refuse what is
too deep, too big or an alias bomb, in one bounded line (issue 28, causes 3 and 5)."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch import config as config_mod
from torchlaunch.base.rules import Bound
from torchlaunch.base.untrusted import QUOTE_LIMIT, TooComplex, check_yaml, load_json, quote
from torchlaunch.core.checkpoint.section import CheckpointConfig
from torchlaunch.core.dist_section import DistConfig
from torchlaunch.core.preemption_section import PreemptionConfig
from torchlaunch.exit_codes import BAD_INPUT, ConfigError
from torchlaunch.live.section import RecoveryConfig
from torchlaunch.trainer_sections import DebugConfig, ModelConfig, OptimConfig, TrainConfig

ONE_LINE = re.compile(r"^config error: (?P<key>[^\s:]+): (?P<what>.+) \((?P<fix>[^()]+)\)$")
SECTIONS = (
    config_mod.DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    CheckpointConfig,
    DistConfig,
    PreemptionConfig,
    RecoveryConfig,
    DebugConfig,
)
PREFIX = {cls: name for name, cls in typing.get_type_hints(config_mod.RunConfig).items() if cls in SECTIONS}


def numeric_keys() -> list[str]:
    """Every int/float field of the sections: a new field without an upper bound fails the test below."""
    keys = []
    for cls in SECTIONS:
        for name, tp in typing.get_type_hints(cls).items():
            if tp in (int, float):
                keys.append(f"{PREFIX[cls]}.{name}")
    return [*keys, "seed"]


def refusal(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_mod.load(None, overrides)
    return info.value


@pytest.mark.parametrize("key", numeric_keys())
@pytest.mark.parametrize("value", ["100000000000000000000000000000000", "-1", ".nan", ".inf", "-.inf"])
def test_every_number_is_bounded_and_finite(key: str, value: str) -> None:
    err = refusal([f"{key}={value}"])
    m = ONE_LINE.match(str(err))
    assert m and "\n" not in str(err), str(err)
    assert m["key"] == key, str(err)


def test_every_numeric_field_carries_a_bound() -> None:
    bounded = {key for key, rule in config_mod.rules() if isinstance(rule, Bound)}
    assert set(numeric_keys()) <= bounded


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.crop_padding=100000", "data.crop_padding"),  # a 3.8 TB allocation before
        ("data.num_workers=10000", "data.num_workers"),  # a process bomb before
        ("dist.timeout_s=0.000001", "dist.timeout_s"),
        ("optim.warmup_epochs=.inf", "optim.warmup_epochs"),
        ("data.synthetic_train_size=9000000", "data.synthetic_train_size"),  # 9e6 x 3 KiB fits the cap; x 64^2 not
    ],
)
def test_listed_values_are_refused(override: str, key: str) -> None:
    overrides = [override, "data.image_size=64"] if "synthetic" in override else [override]
    assert refusal(overrides).key == key


def test_defaults_and_shipped_configs_still_load() -> None:
    config_mod.load(None)
    for path in sorted((REPO / "configs").glob("*.yaml")):
        config_mod.load(path)


# ------------------------------------------------------------------ parsers: deep, huge, bombs


def bomb(levels: int = 9) -> str:
    """The billion laughs under a known key: 9**10 values once expanded."""
    rows = ['&a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    rows += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "data:\n  image_size: [" + ", ".join(rows) + "]\n"


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("deep-flow", "data:\n  image_size: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested more than 64"),
        ("deep-block", "data:\n" + "".join(" " * i + "-\n" for i in range(2, 200)), "nested more than 64"),
        ("bomb", bomb(), "values once its aliases are expanded"),
        ("loop", "data:\n  image_size: &a [*a]\n", "inside its own anchor"),
        ("huge", "data:\n  image_size:\n" + "  - 1\n" * (50 * 2**20 // 6), "larger than 256 KiB"),
    ],
)
def test_config_files_too_deep_big_or_bombs_are_one_line(tmp_path: Path, name: str, text: str, words: str) -> None:
    f = tmp_path / f"{name}.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        config_mod.load(f)
    message = str(info.value)
    assert words in message and "\n" not in message and len(message) < 600, message
    assert info.value.key == "--config"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.image_size=" + "[" * 60_000 + "]" * 60_000, "data.image_size"),
        ("data.image_size=&a [*a]", "data.image_size"),
        ("data.name." + ".".join(["a"] * 50_000) + "=1", "data.name.a"),
        ("data." + "x" * 100_000 + "=1", None),
    ],
)
def test_overrides_too_deep_or_nested_are_one_bounded_line(override: str, key: str | None) -> None:
    err = refusal([override])
    assert "\n" not in str(err) and len(str(err)) < 1000, str(err)[:2000]
    if key is not None:
        assert err.key == key


def test_quoted_values_are_bounded() -> None:
    err = refusal(["data.name=" + "y" * 100_000])
    assert len(str(err)) < 400 and "yyy..." in str(err)
    looped: list = []
    looped.append(looped)
    for value in ("z" * 10**6, looped, {"k": "a\nb"}, 10**4000):
        text = quote(value)
        assert len(text) <= QUOTE_LIMIT and "\n" not in text


def test_json_of_the_run_dir_is_depth_checked_before_parsing() -> None:
    with pytest.raises(TooComplex):
        load_json("[" * 100_000 + "]" * 100_000)
    assert load_json('{"a": "[[[[[[", "b": [1]}') == {"a": "[[[[[[", "b": [1]}
    with pytest.raises(ValueError, match="non-finite"):
        load_json('{"a": NaN}')
    assert math.isfinite(load_json('{"a": 1e300}')["a"])


def test_yaml_scan_counts_alias_expansion() -> None:
    check_yaml("a: &x [1, 2]\nb: [*x, *x]\n")  # small anchors stay allowed
    with pytest.raises(TooComplex):
        check_yaml(bomb(5))


def test_dataclass_fields_have_no_unbounded_numbers_in_lists() -> None:
    for f in dataclasses.fields(OptimConfig):
        if f.name == "betas":
            assert "bound" in f.metadata


# ------------------------------------------------------------------ launcher options (cause 5)


def _local(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    from torchlaunch.agent import node

    rc = node.main([*argv, "--device", "cpu", "--config", str(REPO / "configs/smoke.yaml"), f"run_dir={tmp_path}"])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--gpus", "99", "--dry-run"], "CPU workers on a machine that runs at most"),
        (
            ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "0"],
            "--master-port must be a port number in 1..65535",
        ),
        (
            ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "65536"],
            "--master-port must be a port number",
        ),
        (["--nnodes", "2", "--master-addr", "bad host!"], "is not a host name or address"),
        (["--nnodes", "2", "--master-addr", "no-such-host.invalid"], "does not resolve"),
        (["--nnodes", "100001", "--master-addr", "127.0.0.1"], "--nnodes must be at most 100000"),
    ],
)
def test_local_machine_shape_is_bounded(argv: list[str], words: str, tmp_path: Path, capsys) -> None:
    rc, err = _local(argv, tmp_path, capsys)
    assert rc == BAD_INPUT and len(err) == 1 and words in err[0], err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--mem-gb", "-5"], "--mem-gb must be >= 1"),
        (["--cpus-per-task", "0"], "--cpus-per-task must be >= 1"),
        (["--master-port", "70000"], "--master-port must be a port number in 1..65535"),
        (["--master-port", "0"], "--master-port must be a port number in 1..65535"),
        (["--tasks-per-node", "5000"], "--tasks-per-node must be at most 1024"),
    ],
)
def test_slurm_options_are_bounded(argv: list[str], words: str, tmp_path: Path) -> None:
    from torchlaunch.backends.slurm import launch as slurm
    from torchlaunch.exit_codes import BadInput

    with pytest.raises(BadInput) as info:
        slurm.parse_args([*argv, "--config", str(REPO / "configs/smoke.yaml"), f"run_dir={tmp_path}"])
    assert words in str(info.value) and "\n" not in str(info.value)


def test_k8s_nodes_above_the_api_limit_is_refused(capsys) -> None:
    from torchlaunch.backends.k8s import launch as k8s

    rc = k8s.main(["--nodes", "100001", "--cpu-only", "--storage-class", "nfs"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == BAD_INPUT and len(err) == 1 and "--nodes must be at most 100000" in err[0], err


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null"])
def test_init_from_a_device_is_one_config_error(target: str) -> None:
    from torchlaunch.worker import init_from

    with pytest.raises(ConfigError, match="not a regular file or a folder") as info:
        init_from.load_weights(target)
    assert info.value.key == "model.init_from"
