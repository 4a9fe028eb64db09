"""Start-up: process start -> first training step done ÷ `python -c "import torch"`.

The project side is the worker's own `startup_s` record in metrics.jsonl (from the kernel's process
start time, so interpreter start-up and every import count). The baseline is a process that only
imports torch, timed the same way (process start -> torch imported). Rounds alternate the two sides;
the figure is the median of the per-round ratios. The recipe is configs/fast.yaml on the shared
CIFAR-10 JPEG copy with a warm decode cache (one untimed run fills it), one process, stopped after
its first step; without the shared copy, synthetic images of the same size stand in (noted).

On a CPU the first step of fast.yaml (1,024 images in 8 passes, ~1 s on 2 cores) is training, not
start-up, and would alone exceed the goal's margin; on a GPU it takes milliseconds. So the CPU figure
runs the recipe with one 128-image pass as its first step (train.batch_size=128): everything else
(imports, data, model, the whitening init, the optimizer) is fast.yaml's. The record also keeps each
run's first-step time and `ready_s` (start-up minus that step).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench.common import REPO, Result, median, median_ratio, unpacked_cifar

COMMAND = "python -m bench.run --only startup"
BASELINE_CODE = "import torch\nfrom torchlaunch.startup import process_age_s\nprint(process_age_s())"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the record: start-up is per machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _env(tree: Path = REPO) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    env.update(PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    return env  # the worker picks its own threads, as a user's run does


def import_torch_s(timeout_s: float = 300) -> float:
    out = subprocess.run(
        [sys.executable, "-c", BASELINE_CODE],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def worker_startup(argv_tail: list[str], run_dir: Path, timeout_s: float = 600, tree: Path = REPO) -> dict:
    """One worker run of the project in `tree`, stopped once it has logged its first step (the rest of
    the run is training and validation, not start-up): its startup record from metrics.jsonl."""
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "train",
            *argv_tail,
            f"run_dir={run_dir}",
            "train.max_steps=2",
            "train.log_every_steps=1",
            "checkpoint.every_epochs=0",
            "train.tta=none",
        ],
        cwd=tree,
        env=_env(tree),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail: list[str] = []
    watchdog = threading.Timer(timeout_s, proc.kill)  # a hung worker ends the read loop (EOF), bounded
    watchdog.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail = (tail + [line])[-20:]
            if "start-up" in line:  # the first progress line: the startup record is already written
                break
        else:
            raise RuntimeError(f"worker exited {proc.wait(timeout=timeout_s)} before its first step: {''.join(tail)}")
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=timeout_s)
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if "startup_s" in r)


def recipe(work: Path, quick: bool) -> tuple[list[str], str]:
    """The worker's arguments and a description of the data."""
    cache = work / "decode-cache"
    if quick:
        return ["--config", "configs/smoke.yaml"], "configs/smoke.yaml (synthetic), quick"
    root = unpacked_cifar(work)
    if root is None:
        return (
            [
                "--config",
                "configs/fast.yaml",
                "data.name=synthetic",
                "data.synthetic_train_size=45000",
                "data.synthetic_val_size=5000",
                "train.batch_size=128",
            ],
            "configs/fast.yaml on synthetic 32x32 images (the shared CIFAR-10 copy was not found)",
        )
    return (
        ["--config", "configs/fast.yaml", f"data.root={root}", f"data.cache_dir={cache}", "train.batch_size=128"],
        "configs/fast.yaml (first step: one 128-image pass) on the shared CIFAR-10 JPEG copy (50,000 images), "
        "warm decode cache",
    )


def run(quick: bool = False, rounds: int = 5, work: Path | None = None) -> Result:
    work = Path(work or tempfile.mkdtemp(prefix="bench-startup-"))
    argv, data = recipe(work, quick)
    run_dir = work / "startup-run"
    worker_startup(argv, run_dir)  # untimed: fills the decode cache (and the OS page cache)
    import_torch_s()
    n = 1 if quick else rounds
    project, baseline, first_step = [], [], []
    for r in range(n):
        sides = ("worker", "torch") if r % 2 == 0 else ("torch", "worker")
        for side in sides:
            if side == "worker":
                record = worker_startup(argv, run_dir)
                project.append(record["startup_s"])
                first_step.append(record.get("first_step_s", float("nan")))
            else:
                baseline.append(import_torch_s())
    shutil.rmtree(run_dir, ignore_errors=True)
    ratio, per_round = median_ratio(project, baseline)  # seconds ÷ seconds: lower is better
    return Result(
        key="startup",
        title='Start-up: process start → first step done ÷ python -c "import torch"',
        project=median(project),
        baseline=median(baseline),
        unit="s",
        ratio=ratio,
        goal=1.5,
        higher_is_better=False,
        command=COMMAND,
        project_label="python -m train, startup_s from its metrics.jsonl",
        baseline_label='python -c "import torch" (process start → imported)',
        rounds=per_round,
        notes=f"{data}; one process; CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; the first step "
        f"itself took {median(first_step):.2f} s of the start-up (median); {n} alternating rounds",
        extra={
            "first_step_s": first_step,
            "startup_s": project,
            "import_torch_s": baseline,
            "cpu": cpu_model(),
            "ready_s": [a - b for a, b in zip(project, first_step, strict=True)],
        },
    )


def against(rev: str, rounds: int = 10, work: Path | None = None) -> Result:
    """This tree's start-up ÷ commit `rev`'s, in the same run: a restructuring must not cost start-up.

    Both sides run the same recipe and data from a worktree each (`rev` checked out detached in a
    temporary one), alternating first place every round; each keeps its own decode cache (the format
    may differ between commits), filled by one untimed run. The figure is the median of the per-round
    ratios of `startup_s`; `ready_s` (start-up minus the first step) is kept beside it."""
    work = Path(work or tempfile.mkdtemp(prefix="bench-startup-against-"))
    tree = work / f"tree-{rev}"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True, capture_output=True)
    try:
        argv, data = recipe(work, quick=False)
        trees = {"this": REPO, rev: tree}
        argvs = {side: [*argv, f"data.cache_dir={work / ('cache-' + side)}"] for side in trees}
        for side, root in trees.items():
            worker_startup(argvs[side], work / "run", tree=root)  # untimed: its decode cache
        runs: dict[str, list[dict]] = {side: [] for side in trees}
        for r in range(rounds):
            for side in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                runs[side].append(worker_startup(argvs[side], work / "run", tree=trees[side]))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False, capture_output=True)
    this = [r["startup_s"] for r in runs["this"]]
    then = [r["startup_s"] for r in runs[rev]]
    ready = {side: [r["startup_s"] - r.get("first_step_s", 0.0) for r in runs[side]] for side in trees}
    ratio, per_round = median_ratio(this, then)
    ready_ratio, _ = median_ratio(ready["this"], ready[rev])
    return Result(
        key="startup_against",
        title=f"Start-up: this tree ÷ commit {rev} (process start → first step done)",
        project=median(this),
        baseline=median(then),
        unit="s",
        ratio=ratio,
        goal=1.03,
        higher_is_better=False,
        command=f"python -m bench.startup --against {rev}",
        project_label="python -m train from this tree, startup_s",
        baseline_label=f"python -m train from a worktree of {rev}, startup_s",
        rounds=per_round,
        notes=f"{data}; {rounds} alternating rounds, separate decode caches; start-up minus the first step: "
        f"ratio {ready_ratio:.3g} (medians {median(ready['this']):.2f} s vs {median(ready[rev]):.2f} s); "
        f"goal: no worse than {rev} beyond the box's round-to-round noise (3%); CPU: {cpu_model()}",
        extra={"startup_s": this, f"startup_s_{rev}": then, "rev": rev},
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--against", metavar="REV", help="compare this tree's start-up with commit REV's instead")
    cli = parser.parse_args()
    result = (
        against(cli.against, rounds=cli.rounds or 10) if cli.against else run(quick=cli.quick, rounds=cli.rounds or 5)
    )
    print(json.dumps(result.to_dict(), indent=1))
