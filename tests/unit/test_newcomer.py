"""test_newcomer: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_newcomer_before_spawn.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from torchlaunch.config import DataConfig
from torchlaunch.data.checks import check_data
from torchlaunch.data.formats import cifar10
from torchlaunch.data.formats.cifar10 import probe_target, unreachable_reason
from torchlaunch.launch import precheck
from torchlaunch.worker import precision


def test_probe_gives_up_on_a_lookup_that_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    never = threading.Event()  # a resolver that hangs, as some offline machines' DNS does

    def hang(*args: object, **kwargs: object) -> None:
        never.wait()
        raise OSError("released by the test")

    monkeypatch.setattr(cifar10.socket, "create_connection", hang)
    reason = unreachable_reason("www.example.invalid", 443, timeout_s=0.2)
    never.set()
    assert reason is not None and "no answer" in reason


def test_probe_targets_the_proxy_when_one_is_set() -> None:
    assert probe_target(env={}) == ("www.cs.toronto.edu", 443)
    assert probe_target(env={"https_proxy": "http://proxy.corp:3128"}) == ("proxy.corp", 3128)
    assert probe_target(env={"TORCHLAUNCH_DOWNLOAD_PROBE": "127.0.0.1:9"}) == ("127.0.0.1", 9)


def test_plugin_data_names_pass_through(tmp_path: Path) -> None:
    check_data(DataConfig(name="my_pkg.data:make", root=str(tmp_path / "nothing")), local=True)


def test_gpu_count_without_torch(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (gpus / bus).mkdir(parents=True)
    nodes = (tmp_path / "nvidiactl",)
    assert precheck.visible_gpus_without_torch({}, gpus, nodes) == 2
    assert precheck.visible_gpus_without_torch({"CUDA_VISIBLE_DEVICES": "1"}, gpus, nodes) == 1
    assert precheck.visible_gpus_without_torch({"CUDA_VISIBLE_DEVICES": ""}, gpus, nodes) == 0
    assert precheck.visible_gpus_without_torch({"CUDA_VISIBLE_DEVICES": "GPU-3f2a"}, gpus, nodes) is None
    assert precheck.visible_gpus_without_torch({}, tmp_path / "no-driver", nodes) == 0
    nodes[0].touch()  # a driver without the proc folder: only torch knows
    assert precheck.visible_gpus_without_torch({}, tmp_path / "no-driver", nodes) is None


def test_gpu_count_agrees_with_torch_here() -> None:
    fast = precheck.visible_gpus_without_torch()
    if fast is not None:
        assert fast == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_a_cap_on_the_cpu_instructions_is_part_of_the_precision_cache_key(monkeypatch) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 makes an AMX CPU train bf16 ~20x slower (issue 58's emulation of a CPU
    without bf16): the uncapped CPU's cached answer must not be reused under the cap."""
    for name in precision.ISA_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    shape = ("fastnet", 64, 10, 32, 32, True, 2)
    plain = precision.cache_key(*shape)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = precision.cache_key(*shape)
    assert plain != capped and json.loads(capped)["isa_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_doctor_names_the_fast_cpu_precision() -> None:
    from torchlaunch.tools.machine_checks import _cpu_precision_finding

    finding = _cpu_precision_finding(
        {"model": "fastnet", "batch": 16, "fp32": 259.0, "bf16": 182.0, "auto_picks": "fp32"}
    )
    assert finding.level == "ok"
    assert "bf16 182 vs fp32 259" in finding.message and "fp32 is the fast one" in finding.message
    broken = _cpu_precision_finding({"model": "fastnet", "error": "RuntimeError: x"})
    assert broken.level == "warn" and "train.precision=fp32" in broken.fix


def test_measurement_leaves_the_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    rates = precision.measure_rates("simple_cnn", 10, 4, 32, 8, channels_last=False, budget_s=0.05)
    assert torch.equal(before, torch.get_rng_state())
    assert rates.fp32 > 0 and rates.bf16 > 0 and rates.batch == 8


def test_choice_is_measured_once_cached_and_recorded_in_the_run(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shape = {
        "model_name": "simple_cnn",
        "width": 4,
        "num_classes": 10,
        "image_size": 32,
        "micro_batch": 8,
        "channels_last": False,
    }
    first, note = precision.choose_for_run(tmp_path / "a", cache, **shape)
    assert first in ("bf16", "fp32") and "measured now" in note and "bf16" in note and "fp32" in note
    assert json.loads((tmp_path / "a" / "precision.json").read_text())["precision"] == first
    again, note = precision.choose_for_run(tmp_path / "b", cache, **shape)
    assert again == first and "cached in" in note
    # The cache changes (another day, another measurement): run a resumes with what it started with,
    # a new run follows the cache.
    entries = json.loads((cache / precision.CACHE_FILE).read_text())
    other = "fp32" if first == "bf16" else "bf16"
    for entry in entries.values():
        entry["precision"] = other
    (cache / precision.CACHE_FILE).write_text(json.dumps(entries))
    resumed, note = precision.choose_for_run(tmp_path / "a", cache, **shape)
    assert resumed == first and "recorded at this run's start" in note
    assert precision.choose_for_run(tmp_path / "c", cache, **shape)[0] == other


def test_a_failed_measurement_picks_fp32_and_is_not_cached(tmp_path: Path) -> None:
    choice, note = precision.choose_for_run(tmp_path / "run", tmp_path / "cache", "simple_cnn", 4, 10, 16, 8, False)
    assert choice == "fp32" and "measurement failed" in note  # simple_cnn's head is sized for 32x32
    assert not (tmp_path / "cache" / precision.CACHE_FILE).exists()


def test_choice_prefers_fp32_unless_bf16_is_clearly_faster() -> None:
    assert precision.Rates(fp32=100.0, bf16=104.0, batch=8).choice == "fp32"
    assert precision.Rates(fp32=100.0, bf16=200.0, batch=8).choice == "bf16"
    assert precision.Rates(fp32=259.0, bf16=182.0, batch=8).choice == "fp32"


def test_a_cpu_without_fast_bf16_trains_the_fast_recipe_in_fp32_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 58: fast.yaml hard-coded bf16, emulated ~16x slower on a CPU without bf16 instructions. Its
    auto choice follows the measurement; bf16 set by hand there says so in one line with the figures."""
    from torchlaunch import config

    emulated = precision.Rates(fp32=99.0, bf16=6.0, batch=32)  # issue 58's AMD EPYC, fastnet, batch 32
    monkeypatch.setattr(precision, "measure_rates", lambda *a, **k: emulated)
    cfg = config.load(REPO / "configs" / "fast.yaml", [f"data.cache_dir={tmp_path / 'cache'}"])
    assert cfg.train.precision == "auto"
    shape = ("fastnet", cfg.model.width, 10, 32, cfg.train.micro_batch_size, cfg.train.channels_last)
    assert precision.choose_for_run(tmp_path / "run", tmp_path / "cache", *shape)[0] == "fp32"
    cfg.train.precision = "bf16"
    line = precision.check_hand_set(cfg, 10, 32, cfg.train.micro_batch_size)
    assert line is not None and "\n" not in line and "16x slower than fp32" in line
    assert "bf16 6 vs fp32 99 images/s" in line and "train.precision=auto" in line
    cfg.train.precision = "fp32"  # the exact choice, here the fast one: nothing to say
    assert precision.check_hand_set(cfg, 10, 32, cfg.train.micro_batch_size) is None
    quick = {"precision": "bf16", "rates": {"fp32": 100.0, "bf16": 150.0, "batch": 32}, "cpu": "x"}
    assert precision.hand_set_note(quick, "fp32", "fastnet") is None  # 1.5x is not "several times"
    quick["rates"]["bf16"] = 300.0
    assert "fp32 trains 3x slower than bf16 on x" in (precision.hand_set_note(quick, "fp32", "fastnet") or "")


def test_every_shipped_recipe_measures_its_precision_or_says_why_not() -> None:
    """Issue 58: a recipe fits the machine it runs on: precision auto, or a fixed one with its reason on the line."""
    from torchlaunch import config

    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert len(recipes) >= 5
    for recipe in recipes:
        cfg = config.load(recipe, [])
        if cfg.train.precision == "auto":
            continue
        line = next(ln for ln in recipe.read_text().splitlines() if ln.strip().startswith("precision:"))
        assert "# why:" in line and len(line.split("# why:", 1)[1].strip()) > 20, f"{recipe.name}: {line}"


def test_bench_states_the_cpu_beside_every_figure() -> None:
    from bench import run as bench_run

    doc = json.loads((REPO / "docs" / "bench-results.json").read_text())
    first = next(iter(doc["results"]))
    doc["results"][first]["cpu"] = "Test CPU 9000"
    doc["preemption"] = {**doc.get("preemption", {}), "cpu": "Test CPU 9000"} if doc.get("preemption") else None
    text = bench_run.render(doc)
    lines = text.splitlines()
    top = lines.index(next(ln for ln in lines if ln.startswith("| figure")))
    table = lines[top : lines.index("", top)]  # the figures table; the GPU section's peer table names its GPU above it
    rows = [ln for ln in table if ln.startswith("| ") and not ln.startswith(("| figure", "|---"))]
    recorded = {r.get("cpu") for r in doc["results"].values()} | {"Test CPU 9000"}
    assert rows and all(any(c and c in r for c in recorded) or bench_run.NO_CPU in r for r in rows)
    assert f"| {doc['results'][first]['title']} |" in next(r for r in rows if "Test CPU 9000" in r)
    details = [ln for ln in text.splitlines() if ln.startswith("- measured ")]
    assert details and all(" CPU " in ln for ln in details)


def test_the_time_to_accuracy_section_names_its_cpu_and_the_precision_chosen() -> None:
    """Issue 58: fast.yaml's figures could only have come from a CPU with fast bf16 and said nothing of
    it; the record now carries the CPU and the precision `auto` chose, and the page shows both."""
    from bench import run as bench_run
    from bench import tta

    doc = json.loads((REPO / "docs" / "bench-results.json").read_text())
    old = tta.recorded()
    assert old is not None and "cpu" not in old  # the 2026-11-30 record predates both fields
    doc["tta"] = old
    assert "- CPU not recorded (2026-11-30: a CPU with fast bf16" in bench_run.render(doc)
    doc["tta"] = {**old, "cpu": "Test CPU 9000", "precision": "fp32", "precision_why": "bf16 6 vs fp32 99 images/s"}
    assert "- CPU Test CPU 9000; precision fp32 (bf16 6 vs fp32 99 images/s)" in bench_run.render(doc)
