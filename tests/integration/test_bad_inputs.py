"""Bad input end to end through the real launcher: exit code 2 and one clear line that names the problem.

Config mistakes are caught by the launcher before torchrun starts (fast); data mistakes are found by the
workers under real torchrun (marked slow). Either way the user sees one error line, not a traceback, and
schedulers see exit code 2 (never retried).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, error_lines, run_launcher
from tests.unit.test_data import write_folder

SMOKE = str(REPO / "configs" / "smoke.yaml")


def problem_lines(stderr: str) -> list[str]:
    """stderr minus the launcher's echo of the command it started (informational, not an error): torchrun's,
    or the live agent's (the default road of several ranks)."""
    echoes = tuple(
        f"launch: {sys.executable} -m {m}" for m in ("torchlaunch.launch.torchrun", "torchlaunch.agent.live")
    )
    return [ln for ln in error_lines(stderr) if not ln.startswith(echoes)]


def on_smoke(run_dir: str | Path, *overrides: str) -> list[str]:
    """The launcher's arguments for the smoke recipe on 2 ranks in run_dir, its keys overridden."""
    return ["--gpus", "2", "--config", SMOKE, f"run_dir={run_dir}", *overrides]


def assert_bad_input(args: list[str], *words: str, timeout: float = 120) -> str:
    rc, out, err = run_launcher(args, timeout=timeout)
    lines = problem_lines(err)
    assert rc == 2, f"exit {rc}, expected 2\nstderr:\n{err}"
    assert len(lines) == 1, "expected exactly one error line on stderr, got:\n" + "\n".join(lines)
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a visible CUDA GPU (the check compares against it)")
def test_more_gpus_than_available(tmp_path: Path) -> None:
    """The CPU-only twin of this test is test_local_launcher.py::test_more_gpus_than_visible. It runs the
    launcher, so it lives on this floor: on the unit floor (until 2026-12-04) the isolation watch failed it
    on an H200 for starting a process, after its own assertions had passed."""
    visible = torch.cuda.device_count()
    assert_bad_input(
        ["--gpus", str(visible + 1), "--config", SMOKE, f"run_dir={tmp_path}"],
        f"GPUS={visible + 1} but only {visible} GPU(s) are visible",
    )


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert_bad_input(
        ["--gpus", "2", "--config", str(missing)], "config error: --config", "file not found", str(missing)
    )


def test_malformed_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 3\n   batch_size: 4\n")
    assert_bad_input(
        ["--gpus", "2", "--config", str(bad), f"run_dir={tmp_path}/run"],
        "config error: --config",
        str(bad),
        "not valid YAML",
        "line 3",
    )


def test_unknown_key(tmp_path: Path) -> None:
    assert_bad_input(
        on_smoke(tmp_path, "optim.lrr=0.1"),
        "config error: optim.lrr: unknown key",
        "did you mean optim.lr?",
    )


def test_wrong_type(tmp_path: Path) -> None:
    assert_bad_input(
        on_smoke(tmp_path, "train.epochs=three"),
        "config error: train.epochs: expected an integer",
        "'three'",
    )


def test_negative_learning_rate(tmp_path: Path) -> None:
    line = assert_bad_input(
        on_smoke(tmp_path, "optim.lr=-0.1"),
        "config error: optim.lr: must be > 0",
        "-0.1",
    )
    assert not (tmp_path / "config.yaml").exists(), line  # refused before anything was written or started


def test_an_exact_grid_that_does_not_divide_the_batch(tmp_path: Path) -> None:
    line = assert_bad_input(
        on_smoke(tmp_path, "train.exact=true", "train.grid_micro_batches=7"),
        "config error: train.grid_micro_batches: 7 micro-batches do not divide train.batch_size=128",
    )
    assert not (tmp_path / "config.yaml").exists(), line  # refused before anything was written or started


@pytest.mark.slow
@pytest.mark.parametrize(
    ("made", "words"), [(False, "does not exist"), (True, "no class folders")], ids=["missing", "empty"]
)
def test_a_missing_or_empty_image_folder(made: bool, words: str, tmp_path: Path) -> None:
    root = tmp_path / "images"
    if made:
        root.mkdir()
    assert_bad_input(on_smoke(tmp_path / "run", "data.name=imagefolder", f"data.root={root}"), str(root), words)


@pytest.mark.slow
def test_missing_cifar10_offline(tmp_path: Path) -> None:
    assert_bad_input(
        on_smoke(tmp_path / "run", "data.name=cifar10", f"data.root={tmp_path}", "data.download=false"),
        str(tmp_path / "cifar-10-batches-py"),
        "data.download=true",
    )


@pytest.mark.slow
def test_corrupt_image_is_named(tmp_path: Path) -> None:
    root = tmp_path / "images"
    write_folder(root, {"a": 20, "b": 20})
    bad = root / "b" / "0007.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    assert_bad_input(
        on_smoke(
            tmp_path / "run",
            "data.name=imagefolder",
            f"data.root={root}",
            f"data.cache_dir={tmp_path}/cache",
            "train.batch_size=8",
        ),
        str(bad),
        "cannot decode image",
    )
