"""test_overhead_startup: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_overhead.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.conftest import error_lines, run_cmd
from torchlaunch.core import checkpoint as ckpt


def test_worker_skips_dynamo_and_reports_startup(tmp_path: Path) -> None:
    """The real worker in-process (so sys.modules can be inspected after it returns)."""
    run_dir = tmp_path / "run"
    probe = (
        "import sys; from torchlaunch.worker.run import main; "
        f"code = main(['--config', 'configs/smoke.yaml', 'run_dir={run_dir}', 'train.max_steps=4', "
        "'train.log_every_steps=2', 'data.synthetic_train_size=512', 'data.synthetic_val_size=64']); "
        "print('DYNAMO', 'torch._dynamo' in sys.modules, 'TORCHVISION', 'torchvision' in sys.modules); "
        "sys.exit(code)"
    )
    rc, out, err = run_cmd([sys.executable, "-c", probe], timeout=180)
    assert rc == 0, out + err
    assert "DYNAMO False TORCHVISION False" in out, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    startup = [r for r in records if "startup_s" in r]
    assert len(startup) == 1 and startup[0]["step"] == 1, records
    assert 0 < startup[0]["startup_s"] < 600
    first_progress = next(line for line in out.splitlines() if " loss " in line)
    assert "start-up" in first_progress and "process start to first step" in first_progress, out
    assert sum("start-up" in line for line in out.splitlines()) == 1  # the first progress line only


def test_non_finite_loss_exits_2_within_the_bound(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rc, out, err = run_cmd(
        [
            sys.executable,
            "-m",
            "train",
            "--config",
            "configs/smoke.yaml",
            f"run_dir={run_dir}",
            "optim.lr=1e30",
            "optim.warmup_epochs=0",
            "train.log_every_steps=4",
            "checkpoint.every_steps=3",
        ],
        timeout=180,
    )
    assert rc == 2, out + err
    lines = error_lines(err)
    assert len(lines) == 1 and "non-finite loss in global steps" in lines[0] and "optim.lr" in lines[0], err
    last = int(lines[0].split("global steps ")[1].split(" ")[0].split("-")[1])
    # The bound (Trainer.NAN_CHECK_BOUND): the first log point (4) or checkpoint (3) after the NaN.
    assert last <= 4, lines[0]
    train_losses = [
        json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln
    ]
    assert all(v == v and abs(v) != float("inf") for v in train_losses)
    committed = ckpt.candidates(run_dir / "checkpoints")
    for _, path in committed:  # every checkpoint that exists was checked finite before it was written
        state = ckpt.load_state(path)
        assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def test_bench_startup_quick_is_well_formed(tmp_path: Path) -> None:
    from bench import startup

    r = startup.run(quick=True, work=tmp_path)
    assert r.key == "startup" and r.goal == 1.5 and not r.higher_is_better
    assert r.project > 0 and r.baseline > 0 and r.ratio == r.rounds[0] > 0
    assert "CPU:" in r.notes and r.command.startswith("python -m bench.run")
