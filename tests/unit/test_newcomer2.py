"""What misled a new user (issue 38, item 9), one test per cause, each failing on 9d2744e: an override
the recipe never reads, a split layout read as classes, the image size nobody named, a README that
contradicted itself, 0-based epochs beside 1-based ones, a finished run's stale step, an evaluation
that asked for a root the run recorded, a warning from every rank, a --dry-run command that could not
run, simple_cnn failing after spawn, typo hints that missed, a bare --help-config, and the license
table every install warned about. In-process where a call proves it; one subprocess runs the printed
--dry-run command, since "runs as printed" is the claim."""

from __future__ import annotations

import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import REPO
from torchlaunch import config as config_mod
from torchlaunch import status as status_mod
from torchlaunch.agent import node
from torchlaunch.config import DataConfig
from torchlaunch.data.checks import check_data
from torchlaunch.exit_codes import BAD_INPUT, OK, BadInput, ConfigError
from torchlaunch.jobs import cli as jobs_cli
from torchlaunch.jobs import progress, state
from torchlaunch.launch import cli

README = (REPO / "README.md").read_text()
USER_CODE = (REPO / "docs" / "user-code.md").read_text()
"""Where the README's "Your own code" section (the refused torchrun/accelerate options) now lives."""
SMOKE = str(REPO / "configs" / "smoke.yaml")


def dry_run(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    """launch.local --dry-run in this process: (exit code, stdout, stderr lines)."""
    code = node.main(["--device", "cpu", "--dry-run", *args, f"run_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    return code, out, [ln for ln in err.splitlines() if ln.strip()]


def config_error(overrides: list[str], path: str | None = SMOKE) -> str:
    with pytest.raises(ConfigError) as caught:
        config_mod.load(path, overrides)
    return str(caught.value)


def write_images(root: Path, classes: dict[str, int], size: int = 8) -> None:
    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


# ------------------------------------------------------------------ a. data.root the recipe never reads


def test_data_root_on_a_synthetic_recipe_is_refused_naming_the_data_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = config_error([f"data.root={tmp_path}"])
    assert line.startswith("config error: data.root: ") and "synthetic" in line
    assert "data.name=imagefolder" in line and "data.name=shards" in line
    code, out, err = dry_run(["--config", SMOKE, f"data.root={tmp_path}"], tmp_path, capsys)
    assert code == BAD_INPUT and out == "" and len(err) == 1 and "data.name=imagefolder" in err[0]
    assert not (tmp_path / "run").exists()
    # read, so accepted: with a data.name that reads it, and a resolved config.yaml (every default in it)
    write_images(tmp_path / "imgs", {"a": 2, "b": 2})
    assert config_mod.load(SMOKE, ["data.name=imagefolder", f"data.root={tmp_path / 'imgs'}"]).data.root
    resolved = config_mod.load(SMOKE, [f"run_dir={tmp_path / 'r'}"])
    assert config_mod.from_dict(config_mod.to_dict(resolved)).data.root == "data"


# ------------------------------------------------------------------ b. train/ and val/ are splits, not classes


def test_a_split_layout_is_refused_pointing_at_its_train_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "dataset"
    write_images(root / "train", {"cat": 2, "dog": 2})
    write_images(root / "val", {"cat": 1, "dog": 1})
    with pytest.raises(BadInput) as caught:
        check_data(DataConfig(name="imagefolder", root=str(root)), local=True)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("data error: ") and "not class folders" in line
    assert f"data.root at {str(root / 'train')!r}" in line and "data.val_fraction" in line
    assert f"--data-root {str(root / 'val')!r}" in line
    code, _, err = dry_run(["--config", SMOKE, "data.name=imagefolder", f"data.root={root}"], tmp_path, capsys)
    assert code == BAD_INPUT and len(err) == 1 and "not class folders" in err[0]
    check_data(DataConfig(name="imagefolder", root=str(root / "train")), local=True)  # the fix works


# ------------------------------------------------------------------ c. the image size is said


def fake_trainer(**where: int) -> types.SimpleNamespace:
    """What Trainer._opening_line reads, without building a model."""
    cfg = config_mod.load(SMOKE, ["data.image_size=36"])
    plan = types.SimpleNamespace(steps_per_epoch=16, global_batch=128, accumulation=1, shares_text=lambda: "64 x 2")
    return types.SimpleNamespace(
        cfg=cfg,
        progress=types.SimpleNamespace(**where),
        plan=plan,
        ctx=types.SimpleNamespace(world_size=2),
        device=torch.device("cpu"),
        precision="fp32",
        gradient_path="ddp",
    )


def test_the_start_line_states_the_image_size_and_the_readme_names_its_option() -> None:
    from torchlaunch.worker.trainer import Trainer

    line = Trainer._opening_line(fake_trainer(epoch=0, step_in_epoch=0, global_step=0), None)
    assert line.startswith("starting simple_cnn on 2 x cpu") and "36x36 px (data.image_size)" in line
    [own_folders] = [ln for ln in README.splitlines() if "ARGS=" in ln and "class-folder tree" in ln]
    command, _, comment = own_folders.partition("#")
    assert "data.image_size=" in command and "data.image_size" in comment


# ------------------------------------------------------------------ d. the docs say what is refused, truly


def test_every_option_the_readme_calls_refused_is_refused_and_nnodes_ranges_are_not() -> None:
    after = USER_CODE.split("torchrun's and accelerate's spellings are accepted", 1)[1]
    paragraph = " ".join(after.split("\n\n")[0].split())
    refused_sentence = paragraph.split(" are refused in one line naming ours")[0].rsplit(". ", 1)[-1]
    named = [m.split("|")[0] for m in re.findall(r"`(--[^`]+)`", refused_sentence)]
    assert "--tee" in named and len(named) >= 8, refused_sentence
    known = ["--gpus", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--device"]
    for option in named:
        with pytest.raises(BadInput):
            cli.translate(option.split(), known)
    assert cli.translate(["--nnodes", "1:2"], known) == ["--nnodes", "1:2"]
    assert not any(o.startswith("--nnodes") for o in named), "docs/user-code.md calls --nnodes MIN:MAX refused"
    assert "--nnodes 1:2" in paragraph and "#degraded-restart" in paragraph


# ------------------------------------------------------------------ e. epochs count from 1 for people


def test_status_and_the_resumed_line_count_epochs_from_one() -> None:
    from torchlaunch.worker.trainer import Trainer

    st = state.Status("running", "making progress", step=20, total=48, epoch=0)
    text = jobs_cli.render_status(Path("runs/a"), st, now=0.0)
    assert "step:       20/48  epoch 1 " in text
    assert st.to_json()["epoch"] == 0  # the stored field keeps its meaning (the heartbeat's index)
    line = Trainer._opening_line(fake_trainer(epoch=1, step_in_epoch=4, global_step=20), Path("ckpt"))
    assert line == "resumed from ckpt at epoch 2/3 step 4/16 (global step 20)"


# ------------------------------------------------------------------ f. an ended run shows its last step


def test_an_ending_rank_leaves_its_last_step_in_its_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 0.1, 0.2, 0.3])
    beat = progress.Heartbeat(tmp_path, 0, interval_s=5.0, clock=lambda: next(clock))
    monkeypatch.setattr(progress, "_writer", beat)
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(tmp_path))  # as under a launcher
    progress.heartbeat(1, total=3, epoch=0)  # written
    progress.heartbeat(2, total=3, epoch=0)  # held back by the interval
    progress.heartbeat(3, total=3, epoch=0)  # the run's last step, held back too
    assert progress.read_all(tmp_path)[0][0].step == 1
    status_mod.report(0, OK, "finished", run_dir=str(tmp_path / "run"))  # the runner's last word of a rank
    [seen], _ = progress.read_all(tmp_path)
    assert (seen.step, seen.total, seen.epoch) == (3, 3, 0)


# ------------------------------------------------------------------ g. evaluate finds the run's recorded set


def test_evaluate_uses_the_recorded_root_of_a_shard_run(tmp_path: Path) -> None:
    from torchlaunch.data.shards import ShardSet, writer
    from torchlaunch.worker import evaluate

    write_images(tmp_path / "imgs", {"a": 6, "b": 6})
    writer.write(tmp_path / "imgs", tmp_path / "set", val_fraction=0.25)
    run_cfg = config_mod.to_dict(config_mod.load(SMOKE, ["data.name=shards", f"data.root={tmp_path / 'set'}"]))
    images, classes = evaluate.load_eval_set(run_cfg, None, "auto", "all")
    assert classes == ["a", "b"] and len(images) == len(ShardSet.open(tmp_path / "set" / "val")) > 0
    folder_cfg = config_mod.to_dict(config_mod.load(SMOKE, ["data.name=imagefolder", f"data.root={tmp_path}"]))
    with pytest.raises(BadInput, match="--data-root is required.*--split val"):
        evaluate.load_eval_set(folder_cfg, None, "auto", "all")  # its every image may be a training image


# ------------------------------------------------------------------ h. torch's worker warning: once, by rank 0


# ------------------------------------------------------------------ i. --dry-run prints a command that runs


# ------------------------------------------------------------------ j. simple_cnn's sizes, before any rank


@pytest.mark.parametrize("size", [16, 31, 32, 39, 40, 64])
def test_simple_cnn_sizes_are_judged_with_the_config(
    size: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchlaunch.worker.models import simple_cnn

    try:
        config_mod.load(SMOKE, [f"data.image_size={size}"])
        accepted = True
    except ConfigError as e:
        assert str(e).startswith("config error: data.image_size: model.name=simple_cnn takes 32-39 px")
        accepted = False
    try:
        simple_cnn(3, 4).eval()(torch.zeros(1, 3, size, size))
        runs = True
    except RuntimeError:
        runs = False
    assert accepted == runs  # the config's rule is the model's
    if not accepted:
        code, out, err = dry_run(["--config", SMOKE, f"data.image_size={size}"], tmp_path, capsys)
        assert code == BAD_INPUT and out == "" and len(err) == 1 and "data.image_size" in err[0]


# ------------------------------------------------------------------ k. typo hints that hit


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("optim.learning_rate=0.1", "did you mean optim.lr?"),
        ("trian.epochs=3", "did you mean train.epochs?"),
        ("learning_rate=0.1", "did you mean optim.lr?"),
        ("lr=0.1", "did you mean optim.lr?"),
        ("train.lr=0.1", "did you mean optim.lr?"),
        ("optim.lrr=0.1", "did you mean optim.lr?"),
        ("train.epochz=3", "did you mean train.epochs?"),
    ],
)
def test_config_typos_get_the_key_meant(override: str, hint: str) -> None:
    assert config_error([override]).endswith(f"({hint})")


def test_option_typos_get_the_option_meant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = dry_run(["--gpu", "2", "--config", SMOKE], tmp_path, capsys)
    assert code == BAD_INPUT and err == [
        "launch error: unrecognized arguments: --gpu; did you mean --gpus? (see python -m launch.local --help)"
    ]
    code, _, err = dry_run(["--bogus", "--config", SMOKE], tmp_path, capsys)
    assert err == ["launch error: unrecognized arguments: --bogus (see python -m launch.local --help)"]


# ------------------------------------------------------------------ l. --help-config says default and meaning


def test_help_config_gives_every_key_its_default_and_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    from torchlaunch.worker import run

    assert run.main(["--help-config"]) == OK
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(config_mod.all_keys())
    for key, line in zip(config_mod.all_keys(), lines, strict=True):
        left, _, meaning = line.partition("  # ")
        assert left.startswith(f"{key}=") and len(meaning) > 8, line
    assert re.match(r"optim\.lr=0\.1 +# Peak learning rate", next(ln for ln in lines if ln.startswith("optim.lr=")))
    assert next(ln for ln in lines if ln.startswith("data.name=")).startswith("data.name=synthetic ")


# ------------------------------------------------------------------ m. an SPDX license, no warning per install


def test_the_license_is_an_spdx_string_for_a_setuptools_that_reads_it() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # a table is deprecated: a warning twice per install
    [setuptools] = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77"  # the first to read PEP 639's string


def test_the_projects_own_loader_worker_default_draws_no_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 item 10: the default data.num_workers=2 drew the project's own contention note on every
    2-core launch (each CPU rank is pinned to one core). Only a count set above the default is noted."""
    import os

    from torchlaunch import config
    from torchlaunch.worker.data import BatchPlan, ImageSet, Normalizer
    from torchlaunch.worker.data.loaders import TrainLoader

    cfg = config.load(REPO / "configs" / "smoke.yaml", [])
    norm = Normalizer((0.5,) * 3, (0.25,) * 3, torch.device("cpu"), channels_last=False)
    files = [str(tmp_path / f"{i}.png") for i in range(4)]  # never read: the loader is only built
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # a pinned rank: one core

    def built(workers: int) -> TrainLoader:
        images = ImageSet(labels=torch.zeros(4, dtype=torch.int64), files=files)
        return TrainLoader(images, BatchPlan(4, 2, 0, image_size=8), norm, torch.device("cpu"), True, workers, 8)

    default = built(cfg.data.num_workers)
    assert cfg.data.num_workers == 2 and default.num_workers == 2 and default.worker_note is None
    asked = built(3)  # set by hand above the default: said in one line, and used as set
    assert asked.num_workers == 3 and asked.worker_note is not None and "data.num_workers=1" in asked.worker_note
