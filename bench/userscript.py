"""A user's script under the launcher ÷ the same script under plain torchrun: examples/custom_loop.py on
2 CPU ranks, steps/s of its training phase, interleaved rounds, median ratio (goal >= 0.97: the launcher costs nothing measurable).

    python -m bench.run --only userscript     # or: python -m bench.userscript [--quick]

Both sides run the identical script with the same threads (OMP_NUM_THREADS=1 per rank) and a fresh
run dir each round. The training phase is timed by the parent from rank 0's live output: from its
first `step 1/N` line to its `finished:` line, so start-up (torchrun, the runner, torch imports) is
left out on both sides and what is compared is what the launcher could slow down while training:
signal handlers, the runner's runpy frame, the environment it sets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, Result, median, median_ratio, paired_rates

COMMAND = "python -m bench.run --only userscript"
SCRIPT = "examples/custom_loop.py"


def training_steps_per_s(argv: list[str], run_dir: Path, timeout_s: float = 600) -> float:
    """Run one launch; steps/s between rank 0's first step line and its `finished:` line."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = last = None
    first_step = last_step = 0
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.perf_counter()
        if line.startswith("step "):
            step = int(line.split()[1].split("/")[0])
            if first is None:
                first, first_step = now, step
            last, last_step = now, step
        if time.monotonic() > deadline:
            proc.kill()
            break
    code = proc.wait(timeout=60)
    if code != 0 or first is None or last is None or last_step <= first_step:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {code} without a timed training phase")
    return (last_step - first_step) / (last - first)


def run(quick: bool = False, rounds: int = 7, epochs: int = 24) -> Result:
    if quick:
        rounds, epochs = 1, 1
    work = Path(tempfile.mkdtemp(prefix="bench-userscript-"))
    args = [SCRIPT, "--epochs", str(epochs), "--run-dir"]
    launcher = [
        sys.executable,
        "-m",
        "torchlaunch.agent",
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--",
        *args,
        str(work / "launcher"),
    ]
    plain = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *args,
        str(work / "torchrun"),
    ]
    try:
        rates = paired_rates(
            {
                "launcher": lambda: training_steps_per_s(launcher, work / "launcher"),
                "torchrun": lambda: training_steps_per_s(plain, work / "torchrun"),
            },
            rounds,
            warmup=0 if quick else 1,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio, per_round = median_ratio(rates["launcher"], rates["torchrun"])
    return Result(
        key="userscript",
        title="A user's script under launch.local ÷ under plain torchrun (training steps/s)",
        project=median(rates["launcher"]),
        baseline=median(rates["torchrun"]),
        unit="steps/s",
        ratio=ratio,
        goal=0.97,
        higher_is_better=True,
        command=COMMAND,
        project_label=f"python -m launch.local --gpus 2 --device cpu -- {SCRIPT}",
        baseline_label=f"python -m torch.distributed.run --standalone --nproc-per-node 2 {SCRIPT}",
        rounds=per_round,
        notes=f"{SCRIPT} (torchlaunch.api, a small MLP, global batch 64) for {epochs} epochs of 32 steps on 2 CPU ranks x "
        f"1 thread, {rounds} alternating rounds after a warm-up pair; each side timed from rank 0's first "
        f"step line to its last, start-up excluded on both",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    result = run(quick=parser.parse_args().quick)
    print(
        f"{result.title}: {result.project:.1f} / {result.baseline:.1f} steps/s = {result.ratio:.3f} "
        f"(rounds {', '.join(f'{r:.3f}' for r in result.rounds)}; goal >= {result.goal})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
