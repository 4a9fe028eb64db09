"""Hostile input, each reproduced with real files and a real worker process: exit 2, one line, no traceback.

Schedulers retry exit 1, so bad input that ends as a traceback becomes a retry loop. Every attack
here runs `python -m torchlaunch.worker --config ...` (or `python -m torchlaunch.worker.evaluate`,
or the real launcher where it needs two ranks) and asserts exit 2, exactly one line on stderr that
names the problem and the fix, and that nothing was silently used. docs/RELIABILITY.md lists them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, error_lines, run_cmd, run_launcher, run_module
from tests.unit.test_data import write_folder

SMOKE = str(REPO / "configs" / "smoke.yaml")
TINY = [
    "data.synthetic_train_size=256",
    "data.synthetic_val_size=64",
    "model.width=4",
    "train.batch_size=64",
    "train.epochs=1",
    "train.max_steps=4",
    "checkpoint.every_steps=2",
    "checkpoint.async_save=false",
]
"""A run of a few seconds on one CPU process: 4 steps, checkpoints at steps 2 and 4."""


def worker(args: list[str], cwd: Path = REPO, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return run_cmd([sys.executable, "-m", "torchlaunch.worker", *args], timeout=180, cwd=cwd, env=env)


def one_line(rc: int, err: str, *words: str) -> str:
    lines = error_lines(err)
    assert rc == 2, f"exit {rc}, expected 2\nstderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1, "expected exactly one line on stderr, got:\n" + "\n".join(lines)
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    return lines[0]


def image_args(root: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--config",
        SMOKE,
        f"run_dir={tmp_path / 'run'}",
        "data.name=imagefolder",
        f"data.root={root}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.batch_size=8",
        "train.epochs=1",
        "train.max_steps=1",
        *extra,
    ]


# ------------------------------------------------------------------ the config file


def test_config_file_not_utf8(tmp_path: Path) -> None:
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(b"seed: 1\n# caf\xe9 au lait\ntrain:\n  epochs: 1\n")
    one_line(*worker(["--config", str(recipe)])[::2], "config error: --config", str(recipe), "not UTF-8", "UTF-8")


def test_duplicate_key_in_a_recipe_is_refused(tmp_path: Path) -> None:
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(f"run_dir: {tmp_path / 'run'}\ntrain:\n  epochs: 1\n  batch_size: 64\n  epochs: 5\n")
    one_line(*worker(["--config", str(recipe)])[::2], "key 'epochs' appears twice", "lines 3 and 5")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_seed_beyond_64_bits(tmp_path: Path) -> None:
    rc, _, err = worker(["--config", SMOKE, f"run_dir={tmp_path}", f"seed={2**64}"])
    one_line(rc, err, "config error: seed", "below 2**63", str(2**64))


def test_infinite_dist_timeout(tmp_path: Path) -> None:
    rc, _, err = worker(["--config", SMOKE, f"run_dir={tmp_path}", "dist.timeout_s=inf"])
    one_line(rc, err, "config error: dist.timeout_s", "got inf")


def test_run_dir_that_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for run_dir in (blocker, blocker / "run"):
        rc, _, err = worker(["--config", SMOKE, f"run_dir={run_dir}"])
        one_line(rc, err, "config error: run_dir", f"cannot write {run_dir}")
    assert blocker.read_text() == "not a folder"


def test_run_dir_under_a_read_only_path() -> None:
    target = Path("/sys/torchlaunch-run")  # sysfs: not even root may create a folder there
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs")
    rc, _, err = worker(["--config", SMOKE, f"run_dir={target}"])
    one_line(rc, err, "config error: run_dir", f"cannot write {target}")


# ------------------------------------------------------------------ sizes that cannot be allocated


def test_model_too_large_to_allocate(tmp_path: Path) -> None:
    rc, _, err = worker(["--config", SMOKE, f"run_dir={tmp_path}", "model.width=100000000", *TINY[:2]])
    one_line(rc, err, "config error: model.width", "must be at most 8192")  # bounded before any allocation


def test_image_size_too_large_to_allocate(tmp_path: Path) -> None:
    rc, _, err = worker(["--config", SMOKE, f"run_dir={tmp_path}", "data.image_size=1000000", *TINY[:2]])
    one_line(rc, err, "config error: data.image_size", "must be at most 4096")  # bounded before any allocation


# ------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def sgd_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("sgd-run")
    rc, _, err = worker(["--config", SMOKE, f"run_dir={run_dir}", *TINY])
    assert rc == 0, err[-3000:]
    return run_dir


def test_resume_with_another_optimizer(sgd_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(sgd_run, run_dir)
    (run_dir / "model.pt").unlink()
    more = [t.replace("max_steps=4", "max_steps=8").replace("epochs=1", "epochs=2") for t in TINY]
    rc, _, err = worker(["--config", SMOKE, f"run_dir={run_dir}", *more, "optim.name=adamw"])
    one_line(rc, err, "config error: run_dir", "optim.name 'sgd' -> 'adamw'", "--reconfigure")  # config.yaml's rule
    (run_dir / "config.yaml").unlink()  # without the run's config, the resume itself refuses
    rc, _, err = worker(["--config", SMOKE, f"run_dir={run_dir}", *more, "optim.name=adamw"])
    one_line(rc, err, "config error: optim.name", "optim.name=sgd, now adamw", "resume with optim.name=sgd")
    assert not (run_dir / "model.pt").exists()


def _forge_marker(run_dir: Path) -> Path:
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    marker = newest / "COMMITTED.json"
    text = marker.read_text()
    size = json.loads(text)["bytes"]
    marker.write_text(
        text.replace(f'"bytes": {size}', '"bytes": Infinity').replace('"val_acc": ', '"val_acc": NaN, "x": ')
    )
    assert "Infinity" in marker.read_text()
    return newest


def test_forged_commit_marker_named_for_resume(sgd_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(sgd_run, run_dir)
    forged = _forge_marker(run_dir)
    (run_dir / "config.yaml").unlink()  # checkpoint.resume=PATH is a change of the run's config (its own rule)
    rc, _, err = worker(["--config", SMOKE, f"run_dir={run_dir}", *TINY, f"checkpoint.resume={forged}"])
    one_line(rc, err, "config error: checkpoint.resume", str(forged), "non-finite number Infinity")


def test_forged_commit_marker_is_skipped_by_auto_resume(sgd_run: Path, tmp_path: Path) -> None:
    """checkpoint.resume=auto skips a checkpoint that does not verify (one warning) for the previous one."""
    run_dir = tmp_path / "run"
    shutil.copytree(sgd_run, run_dir)
    (run_dir / "model.pt").unlink()
    forged = _forge_marker(run_dir)
    rc, out, err = worker(["--config", SMOKE, f"run_dir={run_dir}", *TINY])
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err and f"skipping checkpoint {forged}" in err and "non-finite number" in err
    assert "resumed from" in out and "step-000000002" in out  # the previous, valid one


# ------------------------------------------------------------------ image folders


def test_empty_class_folder_is_named(tmp_path: Path) -> None:
    root = tmp_path / "images"
    write_folder(root, {"cat": 10, "dog": 10})
    (root / "eel").mkdir()
    rc, _, err = worker(image_args(root, tmp_path))
    one_line(rc, err, "data error: class folder", str(root / "eel"), "has no images")


def _png_header_only(path: Path, width: int, height: int) -> None:
    """A few bytes that claim width x height pixels: what a decompression bomb's header says."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


@pytest.mark.parametrize("loader", ["auto", "pil"])
def test_decompression_bomb_is_refused(tmp_path: Path, loader: str) -> None:
    root = tmp_path / "images"
    write_folder(root, {"a": 10, "b": 10})
    bomb = root / "b" / "0003.png"
    _png_header_only(bomb, 20000, 20000)
    rc, _, err = worker(image_args(root, tmp_path, f"data.loader={loader}"))
    one_line(rc, err, "data error: image", str(bomb), "too large to decode", "400000000 pixels")


def test_non_utf8_file_name_is_named(tmp_path: Path) -> None:
    root = tmp_path / "images"
    write_folder(root, {"a": 10, "b": 10})
    os.rename(root / "b" / "0003.png", os.fsencode(root / "b") + b"/caf\xe9.png")
    rc, _, err = worker(image_args(root, tmp_path))
    one_line(rc, err, "data error: the file name b'caf\\xe9.png'", "is not UTF-8", "rename it")


def test_cache_dir_that_is_a_file(tmp_path: Path) -> None:
    root = tmp_path / "images"
    write_folder(root, {"a": 10, "b": 10})
    blocker = tmp_path / "cache-file"
    blocker.write_text("x")
    rc, _, err = worker([*image_args(root, tmp_path), f"data.cache_dir={blocker}"])
    one_line(rc, err, f"data error: data.cache_dir {blocker} cannot be written", "a file, not a folder")


def test_cache_dir_read_only(tmp_path: Path) -> None:
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs")
    root = tmp_path / "images"
    write_folder(root, {"a": 10, "b": 10})
    rc, _, err = worker([*image_args(root, tmp_path), "data.cache_dir=/sys/torchlaunch-cache"])
    one_line(rc, err, "data error: data.cache_dir /sys/torchlaunch-cache cannot be written")


def test_overwritten_decode_cache_is_rebuilt(tmp_path: Path) -> None:
    """Same shape, other bytes: the checksum in meta.json no longer matches, so the folder is decoded again."""
    root = tmp_path / "images"
    write_folder(root, {"a": 10, "b": 10})
    rc, _, err = worker(image_args(root, tmp_path))
    assert rc == 0, err[-3000:]
    (images_file,) = (tmp_path / "cache").glob("imagefolder-*/images.npy")
    good = np.load(images_file)
    np.save(images_file, np.zeros_like(good), allow_pickle=False)  # garbage of the same shape
    shutil.rmtree(tmp_path / "run")
    rc, _, err = worker(image_args(root, tmp_path))
    assert rc == 0, err[-3000:]
    (rebuilt,) = (tmp_path / "cache").glob("imagefolder-*/images.npy")
    assert np.array_equal(np.load(rebuilt), good)  # decoded anew, not the zeros


# ------------------------------------------------------------------ evaluate never runs a checkpoint's code


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run whose model is a plug-in from a folder of its own; importing it leaves a marker file."""
    base = tmp_path_factory.mktemp("foreign")
    pkg = base / "theirs"
    pkg.mkdir()
    (pkg / "foreign_models.py").write_text(
        "import os, pathlib\n"
        "pathlib.Path(os.environ.get('FOREIGN_MARKER', os.devnull)).write_text('imported')\n"
        "from torchlaunch.worker.models import build_model\n"
        "def net(num_classes, width=0):\n"
        "    return build_model('simple_cnn', num_classes, width or 4)\n"
    )
    run_dir = base / "run"
    images = base / "images"
    write_folder(images, {"a": 12, "b": 12})
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(pkg)])}
    rc, _, err = worker([*image_args(images, base), "model.name=foreign_models:net"], env=env)
    assert rc == 0, err[-3000:]
    return run_dir, pkg


def _evaluate(run_dir: Path, cwd: Path, marker: Path, *extra: str) -> tuple[int, str, str]:
    env = {"PYTHONPATH": str(REPO), "FOREIGN_MARKER": str(marker)}
    images = run_dir.parent / "images"
    argv = [sys.executable, "-m", "torchlaunch.worker.evaluate", "--run-dir", str(run_dir), "--data-root", str(images)]
    argv += extra
    return run_cmd(argv, timeout=180, cwd=cwd, env=env)


def test_evaluate_refuses_a_recorded_plugin_without_consent(plugin_run: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir, pkg = plugin_run
    marker = tmp_path / "imported"
    rc, out, err = _evaluate(run_dir, tmp_path, marker)
    one_line(rc, err, "evaluate error", "model.name=foreign_models:net", str(pkg), "--trust-plugin")
    assert not marker.exists()  # the module was never imported
    assert out.strip() == ""


def test_evaluate_imports_a_recorded_plugin_with_trust(plugin_run: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir, _ = plugin_run
    marker = tmp_path / "imported"
    rc, out, err = _evaluate(run_dir, tmp_path, marker, "--trust-plugin")
    assert rc == 0, err[-3000:]
    assert marker.read_text() == "imported"
    assert json.loads(out.strip().splitlines()[-1])["samples"] == 24


def test_evaluate_imports_a_plugin_the_user_can_import(plugin_run: tuple[Path, Path], tmp_path: Path) -> None:
    """Run from the plug-in's own folder: the user's working directory names the module, no flag needed."""
    run_dir, pkg = plugin_run
    marker = tmp_path / "imported"
    rc, out, err = _evaluate(run_dir, pkg, marker)
    assert rc == 0, err[-3000:]
    assert marker.read_text() == "imported"


# ------------------------------------------------------------------ bad input on one rank only


@pytest.mark.slow
def test_bad_input_on_one_rank_ends_the_job_quickly(tmp_path: Path) -> None:
    """Rank 1 raises api.BadInput while rank 0 is in its next collective. Rank 1 must not wait at a
    closing barrier rank 0 never reaches (the process-group timeout, 300 s): it leaves, and the job
    ends as bad input well within the command's bound (120 s, far below that timeout)."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        "from torchlaunch import api\n"
        "with api.setup() as ctx:\n"
        "    if ctx.rank == 1:\n"
        "        raise api.BadInput('data error: shard 1 is unreadable (fix shard 1)')\n"
        "    for step in range(10**6):\n"
        "        api.preemption_requested(step)\n"
    )
    rc, _, err = run_launcher(["--gpus", "2", "--device", "cpu", "--", str(script)], timeout=120)
    assert rc == 2, err[-3000:]
    assert err.count("data error: shard 1 is unreadable (fix shard 1)") == 1, err[-3000:]


def test_evaluate_help_names_the_trust_flag() -> None:
    """The consent is documented where the user looks for it."""
    rc, out, _ = run_module("torchlaunch.worker.evaluate", ["--help"], timeout=60)
    assert rc == 0 and "--trust-plugin" in out
