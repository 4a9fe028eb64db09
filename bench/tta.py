"""Time to accuracy: configs/fast.yaml on the shared CIFAR-10 JPEG copy (its seeded 10% validation
split), 2 CPU processes through python -m launch.local, with the precision the recipe's `auto` measured
on whatever CPU runs it (issue 58): the record names that CPU and that precision. Expensive (tens of minutes on 2 cores), so it
runs only with --full; the default mode reports the last recorded run from docs/bench-tta.json."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, load_average, unpacked_cifar
from torchlaunch.worker.precision import cpu_model, read_json

RECORD = REPO / "docs" / "bench-tta.json"
COMMAND = "python -m bench.run --full --only tta"
GOAL = 0.93
NO_BF16_RECORD = REPO / "docs" / "bench-tta-nobf16.json"
NO_BF16_COMMAND = "python -m bench.run --full --only tta_nobf16"
NO_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
"""Issue 58's "a CPU without bf16" on any CPU: oneDNN and ATen capped at AVX2, so bf16 is emulated (on
this box's AMX CPU 9 vs 126 images/s fp32, as on the AMD EPYC of the issue); the recipe's `auto` must
pick fp32 by itself."""


def run_full(
    work: Path | None = None,
    overrides: tuple[str, ...] = (),
    record: Path = RECORD,
    caps: dict[str, str] | None = None,
    command: str = COMMAND,
) -> dict | None:
    """One full run of fast.yaml; `caps`: ISA caps for its processes (NO_BF16), named in the record."""
    work = work or Path(tempfile.mkdtemp(prefix="bench-tta-"))
    full = unpacked_cifar(work)
    if full is None:
        return None
    run_dir = work / "tta-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [
        sys.executable,
        "-m",
        "torchlaunch.agent",
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--config",
        str(REPO / "configs" / "fast.yaml"),
        f"run_dir={run_dir}",
        f"data.root={full}",
        f"data.cache_dir={work / 'cache'}",
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", **(caps or {}))
    load_before = load_average()
    cpu_before = children_cpu_s()
    start = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    cpu_s = children_cpu_s() - cpu_before
    (work / "tta.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"fast.yaml run failed (exit {out.returncode}): {(out.stdout + out.stderr)[-1500:]}")
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [
        {"epoch": r["epoch"] + 1, "val_acc": r["val_acc"], "elapsed_s": r.get("elapsed_s"), "tta": r.get("tta")}
        for r in lines
        if "val_acc" in r
    ]
    rates = [r["images_per_s"] for r in lines if "images_per_s" in r]
    reached = next((c for c in curve if c["val_acc"] >= GOAL), None)
    chosen = read_json(run_dir / "precision.json")  # the recipe's `auto`: what this CPU was measured to run faster
    result = {
        "cpu": cpu_model(),
        "precision": chosen.get("precision") if isinstance(chosen, dict) else None,
        "precision_why": chosen.get("why") if isinstance(chosen, dict) else None,
        "command": command,
        "isa_caps": caps or {},
        "argv": " ".join(["python", *argv[1:]]),
        "wall_s": wall,
        "cpu_s": cpu_s,
        "curve": curve,
        "final_val_acc": curve[-1]["val_acc"] if curve else None,
        "goal": GOAL,
        "time_to_goal_s": reached["elapsed_s"] if reached else None,
        "median_images_per_s": sorted(rates)[len(rates) // 2] if rates else None,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "overrides": list(overrides),
        "recorded_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(result, indent=1) + "\n")
    return result


def children_cpu_s() -> float:
    """User + system seconds of this process's ended children (the run's launcher and ranks): a figure a
    busy box does not inflate the way it does the wall time."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_no_bf16(work: Path | None = None) -> dict | None:
    return run_full(work, record=NO_BF16_RECORD, caps=NO_BF16, command=NO_BF16_COMMAND)


def recorded(record: Path = RECORD) -> dict | None:
    return json.loads(record.read_text()) if record.is_file() else None


if __name__ == "__main__":
    print(json.dumps(run_full(Path("/tmp/bench-work"), tuple(sys.argv[1:])), indent=1))
