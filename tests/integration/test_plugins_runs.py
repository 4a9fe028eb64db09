"""Plug-in models and datasets by import path, and model.init_from.

Real runs: `python -m train` and `python -m launch.local --gpus 2` (torchrun, 2 CPU ranks on gloo) with
examples/my_models.py and examples/my_data.py, `python -m train.evaluate` on the result from another
working directory, exact resume through the real signal path (TORCHLAUNCH_FAULT_SIGNAL), init_from
across class counts, and every bad plug-in / bad path as a subprocess that must exit 2 with one line.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, error_lines, run_cmd, run_launcher, run_module
from tests.helpers import assert_models_equal, assert_states_equal, final_state
from torchlaunch.worker import init_from

MODEL = "model.name=examples.my_models:tiny_cnn"
DATA = "data.name=examples.my_data:color_blobs"
# color_blobs: 1024 training images / batch 128 = 8 steps per epoch; 2 epochs = 16 steps.
SMALL = [MODEL, DATA, "model.width=0", "train.epochs=2", "checkpoint.every_steps=4"]


def train(run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return run_module(
        "train", ["--config", "configs/smoke.yaml", f"run_dir={run_dir}", *SMALL, *extra], timeout=300, env=env
    )


def final_val_acc(run_dir: Path) -> float:
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_acc" in r][-1]["val_acc"]


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished single-process run with the plug-in model and data (in-memory loader)."""
    run_dir = tmp_path_factory.mktemp("plugin-run")
    rc, out, err = train(run_dir)
    assert rc == 0, err[-3000:]
    return run_dir


@pytest.mark.slow
def test_plugin_model_and_data_train_and_evaluate_from_elsewhere(plugin_run: Path, tmp_path: Path) -> None:
    assert (plugin_run / "model.pt").is_file()
    state = final_state(plugin_run)
    assert state["classes"] == ["red", "green", "blue", "yellow"]
    assert state["config"]["model"]["name"] == "examples.my_models:tiny_cnn"
    assert state["plugins"]["model"]["file"] == str(REPO / "examples" / "my_models.py")
    assert state["plugins"]["data"]["root"] == str(REPO)
    # From a folder where `examples` cannot be imported: the checkpoint's recorded folder is used.
    rc, out, err = run_cmd(
        [sys.executable, "-m", "torchlaunch.worker.evaluate", "--run-dir", str(plugin_run)], cwd=tmp_path, timeout=300
    )
    assert rc == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["samples"] == 256 and report["classes"] == 4
    assert report["accuracy"] == pytest.approx(final_val_acc(plugin_run), abs=1e-9)
    assert report["accuracy"] > 0.5  # 4 classes: well above chance, so the weights really were rebuilt


@pytest.mark.slow
def test_plugin_under_launch_local_resumes_bit_exact(tmp_path: Path) -> None:
    """2 ranks under torchrun on the per-sample loader (data.loader=pil): SIGTERM after step 5 on rank 1,
    exit 75, rerun, and the final state equals an uninterrupted run's bit for bit."""
    common = ["--gpus", "2", "--config", "configs/smoke.yaml", *SMALL, "data.loader=pil", "data.num_workers=0"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    rc, out, err = run_launcher([*common, f"run_dir={reference}"], timeout=300)
    assert rc == 0, err[-3000:]
    rc, out, err = run_launcher(
        [*common, f"run_dir={resumed}"], timeout=300, env={"TORCHLAUNCH_FAULT_SIGNAL": "at=step,n=5,rank=1"}
    )
    assert rc == 75, err[-3000:]
    assert "preempted: checkpoint committed" in out + err
    rc, out, err = run_launcher([*common, f"run_dir={resumed}"], timeout=300)
    assert rc == 0, err[-3000:]
    assert_states_equal(final_state(reference), final_state(resumed))
    assert_models_equal(reference / "model.pt", resumed / "model.pt")


# ----------------------------------------------------------------------------------------------
# init_from


@pytest.mark.slow
def test_init_from_another_class_count(plugin_run: Path, tmp_path: Path) -> None:
    """The 4-class plug-in run's weights into a 10-class run: strict is exit 2 with one line naming the
    counts and the fix; init_strict=false lists the head mismatch in one block and trains; a rerun of
    that run resumes from its own checkpoint and says init_from was ignored."""
    other = ["data.name=synthetic", f"model.init_from={plugin_run}", "train.max_steps=3"]
    rc, out, err = train(tmp_path / "strict", *other)
    assert rc == 2
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("config error: model.init_strict:") and "2 shape-mismatched" in lines[0]
    assert "model.init_strict=false" in lines[0]
    loose = tmp_path / "loose"
    rc, out, err = train(loose, *other, "model.init_strict=false")
    assert rc == 0, err[-3000:]
    assert "loaded 14 tensors; 0 missing, 0 unexpected, 2 shape-mismatched of the model's 16 tensors" in out
    assert "shape mismatch (kept fresh init): 9.weight: checkpoint [4, 32] vs model [10, 32]" in out
    assert "shape mismatch (kept fresh init): 9.bias: checkpoint [4] vs model [10]" in out
    rc, out, err = train(loose, *other, "model.init_strict=false")
    assert rc == 0, err[-3000:]
    assert "ignored: resuming from this run's own checkpoint" in out
    assert "shape mismatch" not in out


@pytest.mark.slow
def test_init_from_every_source_loads_the_same_weights(plugin_run: Path, tmp_path: Path) -> None:
    """Run folder, checkpoint folder, its state.pt, model.pt and a DDP-prefixed state_dict load the same
    tensors; a non-strict load keeps the fresh head, and the fitting tensors are the source's."""
    from examples.my_models import tiny_cnn

    saved = torch.load(plugin_run / "model.pt", weights_only=True)
    newest = final_state(plugin_run)
    checkpoint_dir = sorted((plugin_run / "checkpoints").glob("step-*"))[-1]
    prefixed = tmp_path / "ddp.pt"
    torch.save({"module." + k: v for k, v in saved.items()}, prefixed)
    for source in (plugin_run, checkpoint_dir, checkpoint_dir / "state.pt", plugin_run / "model.pt", prefixed):
        model = tiny_cnn(num_classes=4)
        assert init_from.apply(model, str(source), strict=True).endswith("loaded all 16 tensors")
        for key, value in model.state_dict().items():
            assert torch.equal(value, newest["model"][key]), (source, key)
    torch.manual_seed(0)
    fresh = tiny_cnn(num_classes=7)
    head = fresh[9].weight.detach().clone()
    report = init_from.apply(fresh, str(plugin_run), strict=False)
    assert report.count("\n") == 2 and "9.weight" in report and "9.bias" in report
    assert torch.equal(fresh[9].weight, head)
    assert torch.equal(fresh[0].weight, saved["0.weight"])


# ----------------------------------------------------------------------------------------------
# Bad plug-ins: exit 2 with one line naming the key, the path and the fix


BAD_MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    def raises(num_classes):
        raise ValueError("boom")

    def not_module(num_classes):
        return 42

    def data_raises(root):
        raise RuntimeError("no data here")

    def data_not_a_triple():
        return [1, 2]

    def data_bad_shape():
        return [(torch.zeros(32, 32), 0)] * 4, [(torch.zeros(3, 32, 32), 0)] * 4, ["a", "b"]

    def data_bad_label():
        return [(torch.zeros(3, 32, 32), 0)] * 4, [(torch.zeros(3, 32, 32), 5)] * 4, ["a", "b"]

    def data_bad_item():
        return [torch.zeros(3, 32, 32)] * 4, [(torch.zeros(3, 32, 32), 0)] * 4, ["a", "b"]

    NOT_CALLABLE = 3
""")

BAD_CASES = [
    (
        "model.name=nomod.models:net",
        "config error: model.name: cannot import module 'nomod.models'",
        "add that folder to PYTHONPATH",
    ),
    ("model.name=badplug:missing", "config error: model.name: module 'badplug'", "has no attribute 'missing'"),
    (
        "model.name=badplug:raises",
        "config error: model.name: factory 'badplug:raises' raised ValueError: boom",
        "factory(num_classes=N[, width=W])",
    ),
    (
        "model.name=badplug:not_module",
        "config error: model.name: factory 'badplug:not_module' returned int",
        "not a torch.nn.Module",
    ),
    ("model.name=badplug:NOT_CALLABLE", "config error: model.name: 'badplug:NOT_CALLABLE'", "not a callable"),
    (
        "model.name=brokenimport:net",
        "config error: model.name: module 'brokenimport'",
        "No module named 'dependency_that_is_not_installed'",
    ),
    (
        "data.name=badplug:data_raises",
        "config error: data.name: factory 'badplug:data_raises' raised RuntimeError: no data here",
        "fix the factory",
    ),
    (
        "data.name=badplug:data_not_a_triple",
        "config error: data.name: factory 'badplug:data_not_a_triple' returned list",
        "return (train, val, classes)",
    ),
    (
        "data.name=badplug:data_bad_shape",
        "config error: data.name: 'badplug:data_bad_shape': train sample 0 image is Tensor of shape (32, 32)",
        "3xHxW tensor",
    ),
    (
        "data.name=badplug:data_bad_label",
        "config error: data.name: 'badplug:data_bad_label': val sample 0 label",
        "not an int in [0, 2)",
    ),
    (
        "data.name=badplug:data_bad_item",
        "config error: data.name: 'badplug:data_bad_item': train sample 0 is Tensor",
        "(image, label)",
    ),
    ("data.name=nomod:data", "config error: data.name: cannot import module 'nomod'", "PYTHONPATH"),
    (
        "model.name=my-pkg.models:net",
        "config error: model.name: 'my-pkg.models:net' is not an import path",
        "pkg.module:factory",
    ),
    (
        "model.init_from=/nonexistent/weights.pt",
        "config error: model.init_from: /nonexistent/weights.pt does not exist",
        "a run folder",
    ),
]


@pytest.fixture(scope="module")
def bad_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bad-plugins")
    (folder / "badplug.py").write_text(BAD_MODULE)
    (folder / "brokenimport.py").write_text("import dependency_that_is_not_installed\n")
    return folder


@pytest.mark.parametrize("override,start,fix", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_plugin_exits_2_with_one_line(
    bad_modules: Path, tmp_path: Path, override: str, start: str, fix: str
) -> None:
    rc, out, err = run_module(
        "train",
        ["--config", "configs/smoke.yaml", f"run_dir={tmp_path}", "model.width=0", override],
        env={"PYTHONPATH": f"{REPO}:{bad_modules}"},
    )
    assert rc == 2, err[-2000:]
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(start) and fix in lines[0], lines[0]


@pytest.mark.slow
def test_doctor_reports_which_plugins_resolve(bad_modules: Path) -> None:
    rc, out, err = run_cmd(
        [
            sys.executable,
            "-m",
            "torchlaunch.tools.doctor",
            "--model",
            "",
            "--json",
            "--config",
            "configs/smoke.yaml",
            MODEL,
            "data.name=badplug:missing",
        ],
        env={"PYTHONPATH": f"{REPO}:{bad_modules}"},
        timeout=300,
    )
    assert rc == 2, err[-2000:]
    report = json.loads(out)
    plugins = {p["key"]: p for p in report["facts"]["plugins"]}
    assert plugins["model.name"]["ok"] and plugins["model.name"]["file"] == str(REPO / "examples" / "my_models.py")
    assert not plugins["data.name"]["ok"] and "has no attribute 'missing'" in plugins["data.name"]["error"]
    failed = [f for f in report["findings"] if f["level"] == "fail"]
    assert [f["check"] for f in failed] == ["data.name"] and "fix the name after ':'" in failed[0]["fix"]
