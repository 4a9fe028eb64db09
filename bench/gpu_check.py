"""Two stages of bench/gpu_check.sh (one short call on a lent GPU, docs/GPU.md), each writing JSON:

    python -m bench.gpu_check preempt --data-root /tmp/c10/train --out preempt.json
        a real run through `python -m launch.local --gpus 1` (configs/fast.yaml by default), SIGTERM from
        outside once it logged --stop-at-step, its exit code (75 promised) and checkpoint, then the same
        command again: where it resumed, its exit code (0 promised) and final validation.
    python -m bench.gpu_check gpu224 --work DIR --out gpu224.json [--decode-only]
        bench/gpu224.py's figures as bench.run records them (decode alone first: it is the cheap half).

On a CPU both run too (`preempt --device cpu --config configs/smoke.yaml ...`, `gpu224 --dry-run`): the
dry run of the call, figures meaningless."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def _last_step(run_dir: Path) -> int:
    return max((int(r["step"]) for r in _records(run_dir) if isinstance(r.get("step"), int)), default=-1)


def _final(run_dir: Path) -> dict:
    vals = [r for r in _records(run_dir) if "val_acc" in r]
    rates = [r["images_per_s"] for r in _records(run_dir) if "images_per_s" in r]
    out: dict = {
        "last_step": _last_step(run_dir),
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")),
    }
    if vals:
        out.update(val_acc=vals[-1]["val_acc"], elapsed_s=vals[-1].get("elapsed_s"), epochs_validated=len(vals))
    if rates:
        out["images_per_s_median"] = sorted(rates)[len(rates) // 2]
    return out


def one_gpu_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The project's launcher on one GPU for a recipe (args: device, config, data_root, overrides):
    the command both GPU scripts run (this one and bench/gpu_probe.py)."""
    return [
        sys.executable,
        "-m",
        "launch.local",
        "--gpus",
        "1",
        "--device",
        args.device,
        "--config",
        str(REPO / args.config),
        f"run_dir={run_dir}",
        *([f"data.root={args.data_root}"] if args.data_root else []),
        *args.overrides,
    ]


def preempt(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    argv = one_gpu_argv(args, run_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    report: dict = {"command": " ".join(argv[1:]), "stop_at_step": args.stop_at_step}

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    print(f"preempt: {report['command']}", flush=True)
    start = time.perf_counter()
    first = subprocess.Popen(argv, cwd=REPO, env=env)
    deadline = start + args.first_timeout
    while first.poll() is None and _last_step(run_dir) < args.stop_at_step and time.perf_counter() < deadline:
        time.sleep(0.2)
    seen = _last_step(run_dir)
    signalled = first.poll() is None
    if signalled:
        first.send_signal(signal.SIGTERM)
        print(f"preempt: SIGTERM after {time.perf_counter() - start:.1f} s (last logged step {seen})", flush=True)
    try:
        rc1 = first.wait(timeout=args.stop_timeout)
    except subprocess.TimeoutExpired:
        first.kill()
        first.wait()
        rc1 = f"killed: no exit {args.stop_timeout} s after SIGTERM"
    report["first"] = {
        "signalled": signalled,
        "sigterm_at_s": round(time.perf_counter() - start, 1),
        "step_seen_at_signal": seen,
        "exit": rc1,
        "exit_75": rc1 == 75,
        **_final(run_dir),
    }
    print(f"preempt: first run exit {rc1}: {report['first']}", flush=True)
    save()
    start = time.perf_counter()
    second = subprocess.Popen(argv, cwd=REPO, env=env)  # its output streams on: a cut call still shows it
    try:
        rc2: int | str = second.wait(timeout=args.second_timeout)
    except subprocess.TimeoutExpired:
        second.send_signal(signal.SIGTERM)  # a preemption again: it checkpoints and exits 75
        try:
            second.wait(timeout=args.stop_timeout)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
        rc2 = f"cut after {args.second_timeout} s (SIGTERM, then exit {second.returncode})"
    logs = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("rank-*.log")))
    resumed = [ln for ln in logs.splitlines() if "resumed from" in ln]
    report["second"] = {
        "exit": rc2,
        "wall_s": round(time.perf_counter() - start, 1),
        "resumed_line": resumed[0] if resumed else None,
        **_final(run_dir),
    }
    print(f"preempt: second run exit {rc2}: {report['second']}", flush=True)
    save()
    return 0 if rc1 == 75 and rc2 == 0 and resumed else 1


def gpu224_stage(args: argparse.Namespace) -> int:
    import torch

    from bench import gpu224

    work = Path(args.work)
    cuda = torch.cuda.is_available()
    report: dict = {"gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU)", "torch": torch.__version__}
    if args.decode_only:
        import statistics

        from bench.loader224 import shard_set, write_jpegs

        small = args.dry_run or not cuda
        classes, per_class, batch, rounds = (4, 8, 8, 1) if small else (20, 128, 256, 3)
        t0 = time.perf_counter()
        images = write_jpegs(work / f"jpegs-{classes}x{per_class}", classes, per_class)
        shards = shard_set(images, work / f"shards-{classes}x{per_class}")
        report["prepare_s"] = round(time.perf_counter() - t0, 1)
        if shards is None:
            report["error"] = "the shard writer failed on the generated JPEGs"
        else:
            device = torch.device("cuda", 0) if cuda else torch.device("cpu")
            rates = gpu224.decode_rates(shards, device, batch, rounds)
            report["decode_images_per_s"] = rates["decode"]
            report["decode_crop_images_per_s"] = rates["decode_crop"]
            report["decode_median"] = statistics.median(rates["decode"])
            report["decode_vs_a100_7800"] = report["decode_median"] / gpu224.TV_A100_DECODE
    else:
        results = gpu224.run(work=work, dry_run=args.dry_run) or []
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        report["results"] = {r.key: {**r.to_dict(), "measured_at": stamp, "gpu": report["gpu"]} for r in results}
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    Path(args.out).write_text(text + "\n")
    return 0 if "error" not in report else 1


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    q = sub.add_parser("preempt", help="SIGTERM a real run from outside, then run the same command again")
    q.add_argument("--config", default="configs/fast.yaml")
    q.add_argument("--data-root")
    q.add_argument("--run-dir", default="/tmp/gpu-check-preempt")
    q.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    q.add_argument("--stop-at-step", type=int, default=100)
    q.add_argument("--first-timeout", type=float, default=60, help="s before SIGTERM whatever step it reached")
    q.add_argument("--stop-timeout", type=float, default=30, help="s the run gets to exit after SIGTERM")
    q.add_argument("--second-timeout", type=float, default=60)
    q.add_argument("--out", default="preempt.json")
    q.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    g = sub.add_parser("gpu224", help="bench/gpu224.py's figures as JSON")
    g.add_argument("--work", default="/tmp/gpu224-work")
    g.add_argument("--out", default="gpu224.json")
    g.add_argument("--decode-only", action="store_true")
    g.add_argument("--dry-run", action="store_true", help="on the CPU at tiny sizes, figures meaningless")
    args = p.parse_args()
    return preempt(args) if args.what == "preempt" else gpu224_stage(args)


if __name__ == "__main__":
    sys.exit(main())
