"""Checkpointing: durable save/load ÷ plain torch.save/torch.load, async-save stall ÷ sync
save, resume latency ÷ fresh start, and signal → committed checkpoint with real torchrun."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.common import REPO, Result, median, median_ratio, paired_rates
from bench.harness import make_trainer
from torchlaunch.core import checkpoint as ckpt

COMMAND = "python -m bench.run --only ckpt"
STEP_LINE = re.compile(r"step \d+/\d+ loss")


def _trainer(model: str, batch: int):
    t = make_trainer(
        [
            f"model.name={model}",
            "data.name=synthetic",
            f"data.synthetic_train_size={batch * 4}",
            "data.synthetic_val_size=64",
            f"train.batch_size={batch}",
            "train.precision=bf16",
            "train.epochs=1000",
            "checkpoint.keep=2",
        ]
    )
    t.train_step(next(iter(t.loader.epoch(0, 0)))[1])  # momentum buffers exist, as in a real checkpoint
    return t


def save_load(model: str, batch: int, rounds: int) -> tuple[Result, Result, float]:
    trainer = _trainer(model, batch)
    state = trainer.state_dict()
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=trainer.run_dir))
    counter = itertools.count()

    def durable() -> float:
        root = work / f"d{next(counter)}"
        start = time.perf_counter()
        ckpt.write_checkpoint(root, 1, state, {})
        rate = 1 / (time.perf_counter() - start)
        return rate

    def plain() -> float:
        path = work / f"p{next(counter)}.pt"
        start = time.perf_counter()
        torch.save(state, path)
        return 1 / (time.perf_counter() - start)

    saves = paired_rates({"durable": durable, "plain": plain}, rounds)
    size = next(work.glob("d*/step-*/state.pt")).stat().st_size
    ref_dir = next(work.glob("d*/step-*"))
    ref_file = next(work.glob("p*.pt"))
    loads = paired_rates(
        {
            "durable": lambda: 1 / _seconds(lambda: ckpt.load_state(ref_dir)),
            "plain": lambda: 1 / _seconds(lambda: torch.load(ref_file, weights_only=True)),
        },
        rounds,
    )
    shutil.rmtree(trainer.run_dir, ignore_errors=True)
    save_ratio, save_rounds = median_ratio(saves["plain"], saves["durable"])  # time ratio = inverse rate ratio
    load_ratio, load_rounds = median_ratio(loads["plain"], loads["durable"])
    mb = size / 1e6
    save = Result(
        key="ckpt_save",
        title="Durable save time ÷ plain torch.save",
        project=1 / median(saves["durable"]),
        baseline=1 / median(saves["plain"]),
        unit="s",
        ratio=save_ratio,
        goal=1.35,
        higher_is_better=False,
        command=COMMAND,
        project_label="write_checkpoint (hash, fsync, rename, marker)",
        baseline_label="torch.save (no fsync)",
        rounds=save_rounds,
        notes=f"{model} + SGD momentum state, {mb:.0f} MB, {rounds} interleaved rounds",
    )
    load = Result(
        key="ckpt_load",
        title="Verified load time ÷ plain torch.load",
        project=1 / median(loads["durable"]),
        baseline=1 / median(loads["plain"]),
        unit="s",
        ratio=load_ratio,
        goal=1.35,
        higher_is_better=False,
        command=COMMAND,
        project_label="load_state (xxh3 verify + weights_only load)",
        baseline_label="torch.load(weights_only=True)",
        rounds=load_rounds,
        notes=f"{model} + SGD state, {mb:.0f} MB, {rounds} interleaved rounds",
    )
    return save, load, mb


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def async_stall(model: str, batch: int, rounds: int) -> Result:
    """Time the training thread spends in Trainer.save: async (snapshot + submit) vs synchronous."""
    trainer = _trainer(model, batch)
    steps = itertools.count(1)

    def save(synchronous: bool) -> float:
        trainer.writer.wait()
        trainer.progress.global_step = next(steps)
        trainer.progress.step_in_epoch = trainer.progress.global_step
        seconds = _seconds(lambda: trainer.save(synchronous=synchronous))
        trainer.writer.wait()  # not counted: the next save would wait for it anyway
        return 1 / seconds

    # warmup 2: the first async save into each of the two snapshot buffer sets allocates its pages
    rates = paired_rates({"async": lambda: save(False), "sync": lambda: save(True)}, rounds, warmup=2)
    shutil.rmtree(trainer.run_dir, ignore_errors=True)  # two resnet18 checkpoints: do not leave them in /tmp
    ratio, per_round = median_ratio(rates["sync"], rates["async"])
    return Result(
        key="ckpt_async",
        title="Async save: training stall ÷ synchronous save time",
        project=1 / median(rates["async"]),
        baseline=1 / median(rates["sync"]),
        unit="s",
        ratio=ratio,
        goal=0.1,
        higher_is_better=False,
        command=COMMAND,
        project_label="Trainer.save(synchronous=False): state_dict + copy into reused snapshot buffers + submit",
        baseline_label="Trainer.save(synchronous=True)",
        rounds=per_round,
        notes=f"{model}; the stall is the time save() blocks the training thread; the background write "
        f"then shares the CPU with training (not counted here)",
    )


def _recipe(folder: Path, model: str, batch: int, max_steps: int, extra: dict | None = None) -> Path:
    cfg = {
        "seed": 0,
        "data": {"name": "synthetic", "synthetic_train_size": batch * 50, "synthetic_val_size": 64},
        "model": {"name": model},
        "train": {
            "batch_size": batch,
            "precision": "bf16",
            "channels_last": True,
            "log_every_steps": 1,
            "max_steps": max_steps,
            "epochs": 1,
        },
        "checkpoint": {"every_steps": 1, "keep": 2},
        "debug": {"check_model": False},
    }
    for k, v in (extra or {}).items():
        cfg[k].update(v)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(threads: int) -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1"
    )


def _time_to_first_step(argv: list[str], timeout_s: float = 300) -> float:
    """Seconds from process start to rank 0's first training-step line (then let the run finish)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    deadline = start + timeout_s
    try:
        for line in proc.stdout:
            if first is None and STEP_LINE.search(line):
                first = time.perf_counter() - start
            if time.perf_counter() > deadline:
                break
        proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if first is None or proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: no step line or exit {proc.returncode}")
    return first


def resume_latency(model: str, batch: int, rounds: int) -> Result:
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    recipe = _recipe(work, model, batch, max_steps=2)
    seed_run = work / "seed"
    subprocess.run(
        [sys.executable, "-m", "train", "--config", str(recipe), f"run_dir={seed_run}"],
        cwd=REPO,
        env=_env(1),
        check=True,
        capture_output=True,
        timeout=600,
    )
    source = ckpt.newest_committed(seed_run / "checkpoints")
    counter = itertools.count()

    def fresh() -> float:
        run = work / f"fresh{next(counter)}"
        return 1 / _time_to_first_step(
            [
                sys.executable,
                "-m",
                "train",
                "--config",
                str(recipe),
                f"run_dir={run}",
                "train.max_steps=1",
                "checkpoint.resume=never",
            ]
        )

    def resumed() -> float:
        run = work / f"resumed{next(counter)}"
        return 1 / _time_to_first_step(
            [
                sys.executable,
                "-m",
                "train",
                "--config",
                str(recipe),
                f"run_dir={run}",
                "train.max_steps=3",
                f"checkpoint.resume={source}",
            ]
        )

    rates = paired_rates({"resumed": resumed, "fresh": fresh}, rounds, warmup=0)
    shutil.rmtree(work, ignore_errors=True)
    ratio, per_round = median_ratio(rates["fresh"], rates["resumed"])
    return Result(
        key="ckpt_resume",
        title="Resume latency: start → first resumed step ÷ fresh start → first step",
        project=1 / median(rates["resumed"]),
        baseline=1 / median(rates["fresh"]),
        unit="s",
        ratio=ratio,
        goal=1.2,
        higher_is_better=False,
        command=COMMAND,
        project_label="python -m train, resuming",
        baseline_label="python -m train, fresh",
        rounds=per_round,
        notes=f"{model}, one process, from Popen to rank 0's first step line; {rounds} alternating rounds",
    )


def preemption(model: str, batch: int, max_steps: int, timeout_s: float = 600) -> dict:
    """SIGTERM to launch.local (2 CPU ranks) after the 2nd step; rerun; check step continuity."""
    work = Path(tempfile.mkdtemp(prefix="bench-preempt-"))
    run_dir = work / "run"
    recipe = _recipe(work, model, batch, max_steps, extra={"checkpoint": {"every_steps": 0}})
    argv = [
        sys.executable,
        "-m",
        "torchlaunch.agent",
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--config",
        str(recipe),
        f"run_dir={run_dir}",
    ]
    env = _env(1)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    sent = None
    committed_line = ""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if sent is None and re.search(r"step 2/\d+ loss", line):
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
        if "preempted: checkpoint committed" in line:
            committed_line = line.strip()
        if time.monotonic() > deadline:
            proc.kill()
            break
    code = proc.wait(timeout=60)
    m = re.search(r"global step (\d+) in ([\d.]+) s, ([\d.]+) s after the signal", committed_line)
    if code != 75 or not m:
        raise RuntimeError(f"preemption run: exit {code}, no commit line; tail: {''.join(lines[-15:])}")
    committed_step, seconds_after = int(m.group(1)), float(m.group(3))
    last_logged = max(int(x) for x in re.findall(r"step (\d+)/\d+ loss", "".join(lines)))
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    resumed = re.search(r"resumed from .* \(global step (\d+)\)", again.stdout + again.stderr)
    steps = [
        json.loads(ln)["step"]
        for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(ln)
    ]
    shutil.rmtree(work, ignore_errors=True)
    return {
        "model": model,
        "signal_to_commit_s": seconds_after,
        "committed_step": committed_step,
        "last_step_logged_before_exit": last_logged,
        "resumed_at_step": int(resumed.group(1)) if resumed else None,
        "rerun_exit": again.returncode,
        "steps_logged": steps,
        "max_steps": max_steps,
        "continuous": steps == list(range(1, max_steps + 1)),
        "steps_lost": (last_logged - int(resumed.group(1))) if resumed else None,
    }


def run(quick: bool = False, rounds: int = 5) -> tuple[list[Result], dict]:
    model, batch, max_steps = ("simple_cnn", 16, 5) if quick else ("resnet18", 32, 6)
    r = 1 if quick else rounds
    save, load, _ = save_load(model, batch, r)
    stall = async_stall(model, batch, r)
    resume = resume_latency(model, batch, 1 if quick else 3)
    pre = preemption(model, batch, max_steps)
    return [save, load, stall, resume], pre
