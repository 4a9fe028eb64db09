"""PNG plots for docs/BENCHMARKS.md from docs/bench-results.json (needs matplotlib: run it with the
benchmark venv, bench/.venv-peers, or install the project's `plot` extra)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def ratios_plot(results: dict, out: Path) -> None:
    items = [r for r in results.values() if isinstance(r, dict) and "ratio" in r]
    if not items:
        return
    # Normalise so that 1.0 = goal met exactly, > 1 better than the goal, whichever way the goal points.
    names = [r["key"] for r in items]
    score = [r["ratio"] / r["goal"] if r["higher_is_better"] else r["goal"] / max(r["ratio"], 1e-9) for r in items]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(items) + 1.2))
    colors = ["tab:green" if s >= 1 else "tab:red" for s in score]
    ax.barh(names, score, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("measured ÷ goal (log; right of the line = goal met)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "bench-ratios.png", dpi=110)
    plt.close(fig)


def peers_plot(results: dict, out: Path) -> None:
    peer = results.get("peers_lightning") or results.get("peers_reference")
    if not peer or not peer.get("extra"):
        return
    names, values = zip(*sorted(peer["extra"].items(), key=lambda kv: -kv[1]), strict=False)
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(names, values, color=["tab:blue" if n == "project" else "tab:gray" for n in names])
    ax.set_ylabel("images/s, end to end")
    ax.set_title("stock resnet18, 5,000 images, batch 128, one epoch, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(out / "bench-peers.png", dpi=110)
    plt.close(fig)


def tta_plot(tta: dict | None, out: Path) -> None:
    if not tta or not tta.get("curve"):
        return
    xs = [c["elapsed_s"] for c in tta["curve"]]
    ys = [100 * c["val_acc"] for c in tta["curve"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(xs, ys, marker="o", label="configs/fast.yaml, 2 CPU processes")
    ax.axhline(100 * tta["goal"], color="tab:red", linestyle="--", label=f"goal {100 * tta['goal']:.0f}%")
    ax.scatter([1000], [90], color="tab:gray", label="airbench94 on CPU (issue's reference)")
    ax.set_xlabel("seconds since training start")
    ax.set_ylabel("validation top-1 (%)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "bench-tta.png", dpi=110)
    plt.close(fig)


def main(results_path: str, out_dir: str) -> None:
    data = json.loads(Path(results_path).read_text())
    out = Path(out_dir)
    ratios_plot(data.get("results", {}), out)
    peers_plot(data.get("results", {}), out)
    tta_plot(data.get("tta"), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
