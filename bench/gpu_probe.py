"""Two GPU probes for one short call (docs/GPU.md), each writing JSON or text to --out:

    python -m bench.gpu_probe resume --data-root /tmp/c10/train --out resume.json
        exact resume on the device: the same launcher command (configs/fast.yaml through
        `python -m launch.local --gpus 1`) run twice uninterrupted (is the device run-to-run
        deterministic at all?) and once SIGTERM'd from outside, then run again (exit 75, then 0);
        every RUN_DIR/model.pt compared tensor by tensor with torch.equal (max abs diff). Where the
        uninterrupted runs differ, the same three again with torch.use_deterministic_algorithms
        (warn_only) and cudnn.deterministic set in every process through a sitecustomize.
    python -m bench.gpu_probe probe224 --work /tmp/gpu224-work --out probe224.json
        where bench/gpu224.py's end-to-end time goes: per-step host time in the loader (next) and in
        train_step, the loader alone, the workers alone, data.decode=gpu/cpu at several worker counts,
        and a torch.profiler table of a few data.decode=gpu steps (--profile-out).

On a CPU both run too (`resume --device cpu ...`, `probe224 --dry-run`): the dry run, figures meaningless."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_check import _last_step, one_gpu_argv

REPO = Path(__file__).resolve().parent.parent

SITE = """import os
if os.environ.get("TORCHLAUNCH_PROBE_DET"):
    import torch
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
"""


def _flatten(obj, prefix: str = "") -> dict:
    import torch

    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for k, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    return {}


def compare(a: Path, b: Path) -> dict:
    """model.pt against model.pt: equal tensors, the differing ones and the largest absolute difference."""
    import torch

    if not a.is_file() or not b.is_file():
        return {"error": f"missing: {[str(p) for p in (a, b) if not p.is_file()]}"}
    ta = _flatten(torch.load(a, map_location="cpu", weights_only=True))
    tb = _flatten(torch.load(b, map_location="cpu", weights_only=True))
    differ, worst = [], 0.0
    for k in sorted(set(ta) | set(tb)):
        if k not in ta or k not in tb or ta[k].shape != tb[k].shape or ta[k].dtype != tb[k].dtype:
            differ.append(k)
            worst = float("inf")
            continue
        if not torch.equal(ta[k], tb[k]):
            differ.append(k)
            if ta[k].is_floating_point():
                worst = max(worst, (ta[k].double() - tb[k].double()).abs().max().item())
    return {
        "tensors": len(ta),
        "equal": not differ,
        "differing": len(differ),
        "first_differing": differ[:8],
        "max_abs_diff": worst,
    }


def _launch(argv: list[str], env: dict, timeout: float) -> tuple[object, float]:
    start = time.perf_counter()
    try:
        rc: object = subprocess.run(argv, cwd=REPO, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = f"cut after {timeout} s"
    return rc, round(time.perf_counter() - start, 1)


def resume(args: argparse.Namespace) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    site = work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    report: dict = {"runs": {}, "compare": {}}
    deadline = time.perf_counter() + args.budget

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    def argv(run_dir: Path) -> list[str]:
        return one_gpu_argv(args, run_dir)

    def env(det: bool) -> dict:
        e = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        if det:
            e.update(
                PYTHONPATH=f"{site}{os.pathsep}{REPO}", TORCHLAUNCH_PROBE_DET="1", CUBLAS_WORKSPACE_CONFIG=":4096:8"
            )
        return e

    def left() -> float:
        return deadline - time.perf_counter()

    def plain(name: str, det: bool) -> None:
        run_dir = work / name
        if left() < 20:
            report["runs"][name] = "skipped: out of time"
            return
        rc, wall = _launch(argv(run_dir), env(det), min(args.run_timeout, left()))
        report["runs"][name] = {"exit": rc, "wall_s": wall, "deterministic_mode": det}
        print(f"probe resume: {name}: exit {rc} in {wall} s", flush=True)
        save()

    def preempted(name: str, det: bool) -> None:
        run_dir = work / name
        if left() < 30:
            report["runs"][name] = "skipped: out of time"
            return
        start = time.perf_counter()
        first = subprocess.Popen(argv(run_dir), cwd=REPO, env=env(det))
        stop_by = start + min(args.run_timeout, left() - 15)
        while first.poll() is None and _last_step(run_dir) < args.stop_at_step and time.perf_counter() < stop_by:
            time.sleep(0.1)
        seen, signalled = _last_step(run_dir), first.poll() is None
        if signalled:
            first.send_signal(signal.SIGTERM)
        sig_at = round(time.perf_counter() - start, 1)
        try:
            rc1: object = first.wait(timeout=30)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
            rc1 = "killed: no exit 30 s after SIGTERM"
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
        rc2, wall2 = _launch(argv(run_dir), env(det), max(10, min(args.run_timeout, left())))
        logs = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("rank-*.log")))
        resumed = [ln.strip() for ln in logs.splitlines() if "resumed from" in ln]
        warned = sorted({ln.strip()[:240] for ln in logs.splitlines() if "deterministic" in ln})
        report["runs"][name] = {
            "signalled": signalled,
            "sigterm_at_s": sig_at,
            "step_seen_at_signal": seen,
            "first_exit": rc1,
            "checkpoints_after_first": ckpts,
            "second_exit": rc2,
            "second_wall_s": wall2,
            "resumed_line": resumed[:1],
            "deterministic_mode": det,
            "determinism_warnings": warned[:12],
        }
        print(f"probe resume: {name}: exit {rc1} (SIGTERM at {sig_at} s, step {seen}), then {rc2}", flush=True)
        save()

    def cmp(a: str, b: str) -> dict:
        out = compare(work / a / "model.pt", work / b / "model.pt")
        report["compare"][f"{a} vs {b}"] = out
        print(f"probe resume: {a} vs {b}: {out}", flush=True)
        save()
        return out

    plain("plain1", False)
    plain("plain2", False)
    preempted("resumed", False)
    same = cmp("plain1", "plain2").get("equal")
    cmp("plain1", "resumed")
    cmp("plain2", "resumed")
    if not same or args.always_det:
        plain("det1", True)
        plain("det2", True)
        preempted("det_resumed", True)
        cmp("det1", "det2")
        cmp("det1", "det_resumed")
        cmp("plain1", "det1")
    save()
    return 0


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe224(args: argparse.Namespace) -> int:
    import torch

    from bench import gpu224
    from bench.loader224 import shard_set, write_jpegs
    from torchlaunch.worker.data import gpu_decode

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    classes, per_class = (4, 8) if not cuda else (20, 128)
    batch, size = (8, 64) if not cuda else (256, 224)
    model = "torchvision.resnet50" if cuda else "torchvision.resnet18"
    work = Path(args.work)
    shards = shard_set(
        write_jpegs(work / f"jpegs-{classes}x{per_class}", classes, per_class), work / f"shards-{classes}x{per_class}"
    )
    report: dict = {"gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU dry run)", "torch": torch.__version__}
    report["cores"] = len(os.sched_getaffinity(0))
    report["batch"], report["steps_per_epoch"] = batch, None
    deadline = time.perf_counter() + args.budget

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    shard_data = ["data.name=shards", f"data.root={shards}", "data.train_crop=resized"]
    synthetic = [
        "data.name=synthetic",
        f"data.synthetic_train_size={classes * per_class}",
        "data.synthetic_val_size=64",
        f"data.synthetic_classes={classes}",
    ]
    timers: dict[str, float] = {}

    def timed(name: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] = timers.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    original = {n: getattr(gpu_decode, n) for n in ("to_batch", "decode_batch", "resized_crops")}
    for n, fn in original.items():
        setattr(gpu_decode, n, timed(n, fn))

    def trainer(data: list[str], workers: int):
        gpu_side = "data.decode=gpu" in data
        if not cuda:  # the dry run: the gpu path itself on the CPU (the constructor refuses a CPU device)
            data = [d.replace("data.decode=gpu", "data.decode=cpu") for d in data]
        t = gpu224.trainer_for(data, model, batch, size, device, workers)
        if not cuda and gpu_side:
            t.loader.decode = "gpu"
        return t

    def timeline(name: str, data: list[str], workers: int, steps: int, warm: int = 2) -> None:
        """Host seconds per step waiting in the loader (next) and in train_step, no syncs between."""
        if time.perf_counter() > deadline:
            report[name] = "skipped: out of time"
            return
        t_build = time.perf_counter()
        tr = trainer(data, workers)
        report["steps_per_epoch"] = tr.plan.steps_per_epoch
        build_s = time.perf_counter() - t_build
        stream = itertools.chain.from_iterable(((e, s, b) for s, b in tr.loader.epoch(e, 0)) for e in itertools.count())
        for _ in range(warm):
            tr.train_step(next(stream)[2])
        _sync(device)
        timers.clear()
        nexts, steps_s, firsts = [], [], []
        start = time.perf_counter()
        steps = steps if cuda else 3
        for _ in range(steps):
            t0 = time.perf_counter()
            _, s, b = next(stream)
            t1 = time.perf_counter()
            tr.train_step(b)
            t2 = time.perf_counter()
            nexts.append(round(t1 - t0, 4))
            steps_s.append(round(t2 - t1, 4))
            firsts.append(s == 0)
        _sync(device)
        wall = time.perf_counter() - start
        first_wait = sum(n for n, f in zip(nexts, firsts, strict=True) if f)
        report[name] = {
            "workers": workers,
            "images_per_s": round(steps * batch / wall, 1),
            "wall_s": round(wall, 3),
            "build_s": round(build_s, 2),
            "next_s_total": round(sum(nexts), 3),
            "next_s_epoch_first_steps": round(first_wait, 3),
            "train_step_host_s_total": round(sum(steps_s), 3),
            "in_to_batch_s": round(timers.get("to_batch", 0.0), 3),
            "in_decode_batch_s": round(timers.get("decode_batch", 0.0), 3),
            "in_resized_crops_s": round(timers.get("resized_crops", 0.0), 3),
            "next_s": nexts,
            "train_step_s": steps_s,
        }
        print(
            f"probe224: {name}: {json.dumps({k: v for k, v in report[name].items() if not isinstance(v, list)})}",
            flush=True,
        )
        save()
        del tr

    def loader_only(name: str, data: list[str], workers: int, epochs: int, fake_decode: bool = False) -> None:
        """The loader alone (epochs of batches, decode on the device included unless fake_decode)."""
        if time.perf_counter() > deadline:
            report[name] = "skipped: out of time"
            return
        tr = trainer(data, workers)
        if fake_decode:
            dummy = torch.zeros((batch, 3, size, size), dtype=torch.uint8, device=device)
            gpu_decode.to_batch = lambda b, s, d: [dummy, b["labels"], b["boxes"]]
        try:
            per_epoch, first = [], []
            for e in range(epochs):
                t0 = time.perf_counter()
                n = 0
                for k, (_, _mb) in enumerate(tr.loader.epoch(e, 0)):
                    if k == 0:
                        first.append(round(time.perf_counter() - t0, 3))
                    n += 1
                _sync(device)
                per_epoch.append(round(time.perf_counter() - t0, 3))
        finally:
            gpu_decode.to_batch = timed("to_batch", original["to_batch"])
        report[name] = {
            "workers": workers,
            "fake_decode": fake_decode,
            "epoch_s": per_epoch,
            "first_batch_s": first,
            "images_per_s": round(n * batch * epochs / sum(per_epoch), 1),
        }
        print(f"probe224: {name}: {report[name]}", flush=True)
        save()

    gpu = [*shard_data, "data.decode=gpu"]
    cpu = [*shard_data, "data.decode=cpu"]
    timeline("synthetic", synthetic, 0, 20)
    timeline("gpu_w8", gpu, 8, 30)
    loader_only("loader_gpu_w8", gpu, 8, 2)
    loader_only("workers_only_w8", gpu, 8, 2, fake_decode=True)
    timeline("gpu_w16", gpu, 16, 30)
    timeline("cpu_w8", cpu, 8, 20)
    timeline("cpu_w16", cpu, 16, 20)
    loader_only("loader_cpu_w16", cpu, 16, 2)
    if args.profile_out and time.perf_counter() < deadline:
        from torch.profiler import ProfilerActivity, profile

        tr = trainer(gpu, 8)
        stream = itertools.chain.from_iterable(tr.loader.epoch(e, 0) for e in itertools.count())
        for _ in range(2):
            tr.train_step(next(stream)[1])
        _sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(6 if cuda else 2):
                tr.train_step(next(stream)[1])
            _sync(device)
        ka = prof.key_averages()
        parts = [f"# 6 steps, data.decode=gpu, 8 workers, batch {batch}, {model}\n"]
        parts.append(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        if cuda:
            for key in ("self_device_time_total", "self_cuda_time_total"):
                try:
                    parts.append(ka.table(sort_by=key, row_limit=25, max_name_column_width=60))
                    break
                except (AttributeError, KeyError, ValueError):
                    continue
        syncs = [e for e in ka if "ynchronize" in e.key or "Memcpy" in e.key]
        parts.append("\n# synchronize / memcpy calls\n")
        parts += [f"{e.key}: count {e.count}, cpu total {e.cpu_time_total / 1e3:.1f} ms\n" for e in syncs]
        Path(args.profile_out).write_text("\n".join(parts))
        report["profile"] = {e.key: {"count": e.count, "cpu_ms": round(e.cpu_time_total / 1e3, 1)} for e in syncs}
        save()
    save()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_probe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("resume", help="uninterrupted x2, preempted + resumed, model.pt compared")
    r.add_argument("--config", default="configs/fast.yaml")
    r.add_argument("--data-root", required=True)
    r.add_argument("--work", default="/tmp/gpu-probe-resume")
    r.add_argument("--device", default="cuda", choices=("auto", "cuda", "cpu"))
    r.add_argument("--stop-at-step", type=int, default=130)
    r.add_argument("--run-timeout", type=float, default=60)
    r.add_argument("--budget", type=float, default=150, help="s for all the runs")
    r.add_argument("--always-det", action="store_true", help="the deterministic-mode runs even when plain agree")
    r.add_argument("--out", default="resume.json")
    r.add_argument("overrides", nargs="*")
    g = sub.add_parser("probe224", help="where gpu224's end-to-end time goes")
    g.add_argument("--work", default="/tmp/gpu224-work")
    g.add_argument("--budget", type=float, default=150)
    g.add_argument("--out", default="probe224.json")
    g.add_argument("--profile-out")
    g.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    return resume(args) if args.what == "resume" else probe224(args)


if __name__ == "__main__":
    sys.exit(main())
