"""train.plot: metrics.jsonl parsing (resumes, cut lines) and a real PNG for two runs."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from torchlaunch.tools import plot


def write_run(run_dir: Path, steps: int = 40, lr: float = 0.1, restart_at: int | None = None) -> Path:
    """A synthetic run: train lines every 5 steps, validation every 20; optionally a resume."""
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(5, steps + 1, 5):
        elapsed = step * 0.5
        if restart_at is not None and step > restart_at:
            elapsed = (step - restart_at + 5) * 0.5  # the new process's clock starts near 0
        lines.append(
            {
                "step": step,
                "epoch": step // 20,
                "loss": 2.3 / step**0.3,
                "lr": lr * (1 - step / (steps + 1)),
                "images_per_s": 900.0 + step,
                "elapsed_s": elapsed,
            }
        )
        if step % 20 == 0:
            lines.append(
                {
                    "step": step,
                    "epoch": step // 20,
                    "val_loss": 2.0 / step**0.3,
                    "val_acc": min(0.9, step / 50),
                }
            )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_reading_dedupes_replayed_steps_and_continues_the_clock(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "a", steps=20)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        # resumed from step 10 in a new process: steps 15, 20 redone, clock restarted
        fh.write(
            json.dumps(
                {
                    "step": 15,
                    "epoch": 0,
                    "loss": 1.0,
                    "lr": 0.1,
                    "images_per_s": 1,
                    "elapsed_s": 1.0,
                }
            )
            + "\n"
        )
        fh.write(
            json.dumps(
                {
                    "step": 20,
                    "epoch": 1,
                    "loss": 0.9,
                    "lr": 0.1,
                    "images_per_s": 1,
                    "elapsed_s": 3.0,
                }
            )
            + "\n"
        )
        fh.write('{"step": 25, "epoch": 1, "lo')  # cut by a crash mid-write
    run = plot.read_metrics(run_dir)
    assert [r["step"] for r in run.train] == [5, 10, 15, 20]
    assert [r["loss"] for r in run.train][2:] == [1.0, 0.9]
    assert [r["wall_s"] for r in run.train] == [2.5, 5.0, 11.0, 13.0]  # 10s before the restart
    assert run.skipped_lines == 1
    assert [r["step"] for r in run.val] == [20]
    assert run.val[0]["wall_s"] == 13.0


def test_validation_wall_time_is_interpolated() -> None:
    train = [{"step": 10, "wall_s": 10.0}, {"step": 30, "wall_s": 50.0}]
    assert plot._wall_at(train, 20) == 30.0
    assert plot._wall_at(train, 5) == 10.0
    assert plot._wall_at(train, 40) == 50.0
    assert plot._wall_at([], 3) is None


def test_missing_metrics_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    assert plot.main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plot: no metrics.jsonl in") and str(tmp_path) in err
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as when not installed
    assert plot.main([str(write_run(tmp_path / "a"))]) == 2
    assert "pip install -e '.[plot]'" in capsys.readouterr().err


def test_names_disambiguate_runs_with_the_same_folder_name(tmp_path: Path) -> None:
    assert plot._names([str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run")]) == [
        "x/run",
        "y/run",
    ]
    assert plot._names([str(tmp_path / "a"), str(tmp_path / "b")]) == ["a", "b"]


def test_png_for_two_runs_with_labels_and_legend(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    first = write_run(tmp_path / "baseline")
    second = write_run(tmp_path / "high-lr", lr=0.4, restart_at=20)
    output = tmp_path / "out" / "curves.png"

    assert plot.main([str(first), str(second), "-o", str(output), "--title", "compare"]) == 0
    assert png_size(output) == (1200, 1200)
    assert output.stat().st_size > 20_000  # real curves, not an empty canvas

    figure = plot.make_figure([plot.read_metrics(first), plot.read_metrics(second)])
    axes = figure.axes
    assert len(axes) == 8
    assert [a.get_ylabel() for a in axes[::2]] == [
        "loss (dashed: validation)",
        "validation accuracy",
        "learning rate",
        "images/s",
    ]
    assert {a.get_xlabel() for a in axes[::2]} == {"step"}
    assert {a.get_xlabel() for a in axes[1::2]} == {"wall time (s)"}
    legend = axes[1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["baseline", "high-lr"]
    # each run draws its own curve on every panel: loss panels also carry val loss (dashed)
    assert len(axes[0].get_lines()) == 4 and len(axes[2].get_lines()) == 2
    lr_line = axes[4].get_lines()[1]
    assert max(lr_line.get_ydata()) > 0.3  # the second run's own data, not the first's
