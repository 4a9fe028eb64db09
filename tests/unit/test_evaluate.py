"""train.evaluate: a checkpoint + a data root -> one JSON line; every sample counted once; bad input -> exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import error_lines
from tests.unit.test_data import write_folder
from torchlaunch import config as config_mod
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.worker import evaluate
from torchlaunch.worker.data import split_indices
from torchlaunch.worker.models import build_model

CLASSES = ["cat", "dog", "fox"]
COUNTS = {"cat": 7, "dog": 6, "fox": 8}  # 21 images: odd, so 2 ranks get unequal shards
MEAN, STD = (0.5, 0.45, 0.4), (0.25, 0.3, 0.2)


@pytest.fixture
def setup(tmp_path: Path) -> dict:
    """A class-folder dataset and a run dir with two checkpoints of a small random CNN."""
    data = tmp_path / "data"
    write_folder(data, COUNTS)
    run = tmp_path / "run"
    cfg = config_mod.load(
        None,
        [
            f"run_dir={run}",
            "data.name=imagefolder",
            f"data.root={data}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.val_fraction=0.3",
            "model.name=simple_cnn",
            "model.width=8",
            "train.precision=fp32",
            "train.channels_last=false",
        ],
    )
    models = {}
    for step, seed in ((3, 0), (5, 1)):
        torch.manual_seed(seed)
        model = build_model("simple_cnn", len(CLASSES), 8).eval()
        state = {
            "format_version": ckpt.FORMAT_VERSION,
            "model": model.state_dict(),
            "classes": CLASSES,
            "norm": {"mean": list(MEAN), "std": list(STD)},
            "config": config_mod.to_dict(cfg),
            "progress": {"global_step": step},
        }
        ckpt.write_checkpoint(run / "checkpoints", step, state, {})
        models[step] = model
    return {"data": data, "run": run, "models": models, "cfg": cfg}


def expected(model: torch.nn.Module, data: Path, indices: list[int] | None = None) -> tuple[float, float, int]:
    """Accuracy, mean loss and count computed by hand: PIL decode, (x/255 - mean)/std, forward."""
    files = [(p, label) for label, c in enumerate(CLASSES) for p in sorted((data / c).iterdir())]
    if indices is not None:
        files = [files[i] for i in indices]
    x = torch.stack([torch.from_numpy(np.array(Image.open(p).convert("RGB"))).permute(2, 0, 1) for p, _ in files])
    x = (x.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    y = torch.tensor([label for _, label in files])
    with torch.no_grad():
        logits = model(x)
    acc = int((logits.argmax(1) == y).sum()) / len(files)
    return acc, float(torch.nn.functional.cross_entropy(logits, y)), len(files)


def run_eval(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    rc = evaluate.main(args)
    captured = capsys.readouterr()
    return rc, captured.out, error_lines(captured.err)


def test_all_images_counted_once_with_the_newest_checkpoint(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_eval(["--run-dir", str(setup["run"]), "--data-root", str(setup["data"])], capsys)
    assert rc == 0, err
    assert len(out.splitlines()) == 1
    report = json.loads(out)
    acc, loss, n = expected(setup["models"][5], setup["data"])
    assert report["samples"] == n == 21
    assert report["accuracy"] == pytest.approx(acc, abs=1e-9)
    assert report["loss"] == pytest.approx(loss, rel=1e-4)
    assert report["step"] == 5 and report["classes"] == 3
    assert report["checkpoint"] == str(setup["run"] / "checkpoints" / "step-000000005")


def test_flip_tta_averages_the_mirrored_logits(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_eval(
        ["--run-dir", str(setup["run"]), "--data-root", str(setup["data"]), "--tta", "flip"], capsys
    )
    assert rc == 0, err
    model = setup["models"][5]
    mirrored = torch.nn.Module()
    mirrored.forward = lambda x: 0.5 * model(x) + 0.5 * model(x.flip(-1))
    acc, loss, n = expected(mirrored, setup["data"])
    report = json.loads(out)
    assert report["samples"] == n and report["accuracy"] == pytest.approx(acc, abs=1e-9)
    assert report["loss"] == pytest.approx(loss, rel=1e-4)


def test_val_split_is_the_runs_seeded_split(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_eval(
        ["--run-dir", str(setup["run"]), "--data-root", str(setup["data"]), "--split", "val"], capsys
    )
    assert rc == 0, err
    report = json.loads(out)
    _, val_idx = split_indices(21, 0.3, 0)
    acc, loss, n = expected(setup["models"][5], setup["data"], val_idx.tolist())
    assert report["samples"] == n == 6
    assert report["accuracy"] == pytest.approx(acc, abs=1e-9)
    assert report["loss"] == pytest.approx(loss, rel=1e-4)


def test_explicit_checkpoint_and_batch_size(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    older = setup["run"] / "checkpoints" / "step-000000003"
    rc, out, err = run_eval(
        ["--checkpoint", str(older / "state.pt"), "--data-root", str(setup["data"]), "--batch-size", "4"], capsys
    )
    assert rc == 0, err
    report = json.loads(out)
    acc, _, _ = expected(setup["models"][3], setup["data"])
    assert report["step"] == 3 and report["checkpoint"] == str(older)
    assert report["accuracy"] == pytest.approx(acc, abs=1e-9) and report["samples"] == 21


def test_corrupt_newest_checkpoint_falls_back(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    newest = setup["run"] / "checkpoints" / "step-000000005" / "state.pt"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    newest.write_bytes(bytes(raw))
    rc, out, err = run_eval(["--run-dir", str(setup["run"]), "--data-root", str(setup["data"])], capsys)
    assert rc == 0
    assert json.loads(out)["step"] == 3
    assert len(err) == 1 and "checksum mismatch" in err[0] and "step-000000005" in err[0]

    rc, out, err = run_eval(["--checkpoint", str(newest.parent), "--data-root", str(setup["data"])], capsys)
    assert rc == 2 and out == ""
    assert len(err) == 1 and err[0].startswith("evaluate error:") and "checksum mismatch" in err[0]


def test_bad_inputs_exit_2_with_one_line(setup: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, data = str(setup["run"]), str(setup["data"])
    cases = [
        (["--run-dir", str(tmp_path / "empty-run"), "--data-root", data], "no valid checkpoint under"),
        (["--checkpoint", str(tmp_path / "nope"), "--data-root", data], "is not a checkpoint folder"),
        (["--run-dir", run, "--data-root", str(tmp_path / "no-data")], "does not exist"),
        (["--run-dir", run, "--data-root", data, "--batch-size", "-1"], "--batch-size must be >= 0"),
        (["--run-dir", run, "--data-root", str(tmp_path), "--data-name", "cifar10"], "CIFAR-10 not found"),
    ]
    for args, words in cases:
        rc, out, err = run_eval(args, capsys)
        assert rc == 2 and out == "", args
        assert len(err) == 1 and words in err[0], (args, err)


def test_class_names_must_match(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    (setup["data"] / "fox").rename(setup["data"] / "wolf")
    rc, out, err = run_eval(["--run-dir", str(setup["run"]), "--data-root", str(setup["data"])], capsys)
    assert rc == 2 and out == ""
    assert len(err) == 1 and "differ from the checkpoint's" in err[0] and "wolf" in err[0] and "fox" in err[0]


def test_corrupt_image_is_named(setup: dict, capsys: pytest.CaptureFixture[str]) -> None:
    bad = setup["data"] / "dog" / "0002.png"
    bad.write_bytes(b"garbage")
    rc, out, err = run_eval(["--run-dir", str(setup["run"]), "--data-root", str(setup["data"])], capsys)
    assert rc == 2 and out == ""
    assert len(err) == 1 and str(bad) in err[0]


class FakeCifar10:
    """Stands in for torchvision.datasets.CIFAR10: the real python batches cannot be downloaded here
    (no internet), and torchvision md5-checks them, so no hand-made copy would pass either."""

    classes = CLASSES

    def __init__(self, root: str, train: bool, download: bool) -> None:
        assert not train and not download  # evaluate reads the test batch only and never downloads
        folder = Path(root) / "cifar-10-batches-py"
        files = [(p, label) for label, c in enumerate(CLASSES) for p in sorted((folder / c).iterdir())]
        self.data = np.stack([np.asarray(Image.open(p).convert("RGB")) for p, _ in files])  # N,H,W,C
        self.targets = [label for _, label in files]


def test_cifar10_batches_are_detected(
    setup: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchvision

    root = tmp_path / "cifar"
    setup["data"].rename(root.mkdir() or root / "cifar-10-batches-py")
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCifar10)
    rc, out, err = run_eval(["--run-dir", str(setup["run"]), "--data-root", str(root)], capsys)
    assert rc == 0, err
    report = json.loads(out)
    acc, _, n = expected(setup["models"][5], root / "cifar-10-batches-py")
    assert report["samples"] == n and report["accuracy"] == pytest.approx(acc, abs=1e-9)


def test_default_batch_size_follows_the_trainer() -> None:
    assert evaluate.default_batch_size({"train": {"batch_size": 128}}, 2) == 256
    assert evaluate.default_batch_size({"train": {"batch_size": 1024}}, 2) == 512
    assert evaluate.default_batch_size({"train": {"batch_size": 1024, "micro_batch_size": 128}}, 2) == 256
