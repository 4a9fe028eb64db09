"""`python -m train.plot RUN_DIR [RUN_DIR ...] -o curves.png`: runs as pictures, overlaid.

Reads each RUN_DIR/metrics.jsonl (train lines: step, epoch, loss, lr, images_per_s, elapsed_s;
validation lines: step, epoch, val_loss, val_acc) and draws loss, validation accuracy, learning
rate and throughput against steps (left column) and wall time (right column); the legend is the
run folder's name. matplotlib is an optional extra (`pip install -e '.[plot]'`), imported only here.

Resumed runs: a step logged twice (work redone after a preemption) keeps its last record, and
when elapsed_s restarts from zero in a new process the wall clock continues from where the
previous process stopped, so the time axis shows the total time spent.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchlaunch import exit_codes, rundir
from torchlaunch.exit_codes import BadInput

INSTALL_HINT = "pip install -e '.[plot]' (or pip install matplotlib==3.11.2)"

PANELS = (
    ("loss", "loss (dashed: validation)"),
    ("val_acc", "validation accuracy"),
    ("lr", "learning rate"),
    ("images_per_s", "images/s"),
)


@dataclass
class RunMetrics:
    """One run's records, deduplicated by step, with a monotonic wall clock."""

    name: str
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0


def read_metrics(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    path = rundir.metrics(run_dir)
    if not path.is_file():
        raise BadInput(
            f"plot: no metrics.jsonl in {run_dir} (pass run folders the worker wrote, e.g. "
            "runs/smoke; it logs every train.log_every_steps steps)"
        )
    run = RunMetrics(name=name or Path(run_dir).resolve().name)
    train_by_step: dict[int, dict[str, Any]] = {}
    val_by_step: dict[int, dict[str, Any]] = {}
    offset = last_elapsed = 0.0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            run.skipped_lines += 1  # a line cut by a crash, or foreign content
            continue
        if "loss" in record:
            elapsed = float(record.get("elapsed_s", 0.0))
            if elapsed < last_elapsed:  # a new process after a resume restarted its clock
                offset += last_elapsed
            last_elapsed = elapsed
            train_by_step[step] = {**record, "wall_s": offset + elapsed}
        if "val_acc" in record or "val_loss" in record:
            val_by_step[step] = record
    run.train = [train_by_step[s] for s in sorted(train_by_step)]
    run.val = [val_by_step[s] for s in sorted(val_by_step)]
    for record in run.val:
        record["wall_s"] = _wall_at(run.train, record["step"])
    return run


def _wall_at(train: list[dict[str, Any]], step: int) -> float | None:
    """Wall time of a validation step: linear between the surrounding train records."""
    if not train:
        return None
    before = [r for r in train if r["step"] <= step]
    after = [r for r in train if r["step"] >= step]
    if not before:
        return after[0]["wall_s"]
    if not after:
        return before[-1]["wall_s"]
    lo, hi = before[-1], after[0]
    if hi["step"] == lo["step"]:
        return lo["wall_s"]
    frac = (step - lo["step"]) / (hi["step"] - lo["step"])
    return lo["wall_s"] + frac * (hi["wall_s"] - lo["wall_s"])


def _time_unit(runs: Sequence[RunMetrics]) -> tuple[str, float]:
    longest = max((r["wall_s"] for run in runs for r in run.train), default=0.0)
    if longest >= 2 * 3600:
        return "h", 3600.0
    if longest >= 2 * 60:
        return "min", 60.0
    return "s", 1.0


def make_figure(runs: Sequence[RunMetrics], title: str | None = None) -> Any:
    """A matplotlib Figure (no pyplot, no global state): 4 metrics x (steps, wall time)."""
    from matplotlib.figure import Figure

    unit, scale = _time_unit(runs)
    figure = Figure(figsize=(12, 12), dpi=100, layout="constrained")
    axes = figure.subplots(len(PANELS), 2, squeeze=False)
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        for row, (key, _label) in enumerate(PANELS):
            records = run.val if key == "val_acc" else run.train
            points = [(r["step"], r.get("wall_s"), r[key]) for r in records if r.get(key) is not None]
            for col in (0, 1):
                ax = axes[row][col]
                xs = [p[col] for p in points]
                ys = [p[2] for p in points]
                if col == 1:
                    pairs = [(x / scale, y) for x, y in zip(xs, ys, strict=True) if x is not None]
                    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
                marker = "o" if key == "val_acc" else None
                ax.plot(xs, ys, color=color, marker=marker, markersize=3, label=run.name)
                if key == "loss":
                    _plot_val_loss(ax, run, col, scale, color)
    for row, (_key, label) in enumerate(PANELS):
        axes[row][0].set_ylabel(label)
        for col, xlabel in enumerate(("step", f"wall time ({unit})")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
    axes[0][0].set_title("against steps")
    axes[0][1].set_title("against wall time")
    axes[0][1].legend(loc="upper right", fontsize="small")
    if title:
        figure.suptitle(title)
    return figure


def _plot_val_loss(ax: Any, run: RunMetrics, col: int, scale: float, color: str) -> None:
    """Validation loss dashed on the loss panel: over- and under-fitting at a glance."""
    points = [(r["step"], r.get("wall_s"), r["val_loss"]) for r in run.val if "val_loss" in r]
    pairs = [(p[col], p[2]) for p in points if p[col] is not None]
    if pairs:
        xs = [x / scale if col == 1 else x for x, _ in pairs]
        ax.plot(xs, [y for _, y in pairs], color=color, linestyle="--", marker="o", markersize=3)


def _names(run_dirs: Sequence[str]) -> list[str]:
    """Legend names: the folder's name, or its last two parts when two runs share a name."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("-o", "--output", default="curves.png", help="image to write (png, svg, pdf)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401 - only to fail early with the install hint
    except ImportError:
        print(f"plot: matplotlib is not installed: {INSTALL_HINT}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    try:
        runs = [read_metrics(d, name) for d, name in zip(args.run_dirs, _names(args.run_dirs), strict=True)]
    except BadInput as exc:
        print(exc, file=sys.stderr)
        return exit_codes.BAD_INPUT
    for run in runs:
        if run.skipped_lines:
            print(f"plot: {run.name}: skipped {run.skipped_lines} unreadable line(s)", file=sys.stderr)
        if not run.train and not run.val:
            print(f"plot: {run.name}: no records yet", file=sys.stderr)
    figure = make_figure(runs, args.title)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    print(f"plot: wrote {output} ({len(runs)} run(s))")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
