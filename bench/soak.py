"""Chaos soak (issue #55): live ranks under a fault every few seconds, ending with the fault-free run's bits.

    python -m bench.soak                       # 30 min, 4 ranks, a fault every 30 s (the issue's soak)
    python -m bench.soak --minutes 5 --every 20   # a shorter one
    python -m bench.run --only soak --full     # the same, recorded in docs/BENCHMARKS.md
    SOAK_MINUTES=10 SOAK_EVERY_S=20 python -m bench.run --only soak --full   # a shorter one, recorded

One recipe (synthetic 32 px images, the smoke recipe's BatchNorm CNN at width 4, train.exact, recovery.live,
recovery.rejoin) runs twice with `launch.local --gpus W --device cpu`: once with no fault (the reference,
timed), then with faults delivered from outside in a fixed cycle, each `every` seconds after the last:

- kill: SIGKILL of one rank's process (its agent starts it again: recovery.rejoin; it joins live);
- freeze: SIGSTOP of one rank's process, left stopped: its agent must judge it silent past
  recovery.heartbeat_timeout_s and SIGKILL it (the soak SIGKILLs it itself after FENCE_WAIT_S and says
  so: a fence that never came is a failure of the soak);
- stop: SIGTERM to the launcher (a whole-job preemption: the ranks commit, the launcher exits 75), then
  the same command on the other world size (W <-> W-1): a resume on another world size.

The run must finish with model.pt's SHA-256 (every tensor, in key order) equal to the reference's:
train.exact makes a step's bits independent of which ranks ran it and of what happened to them
(worker/grid.py). Goodput: the reference's steps per second of wall time ÷ the faulted run's, both from
the first launch to the last exit (the faulted one includes its relaunches and re-run steps).
Victims are drawn by a seeded generator (SOAK_SEED), so a failing soak can be replayed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import REPO, Result, load_average
from bench.live import config_text, rank_pids
from torchlaunch.base import procs

COMMAND = "python -m bench.run --only soak --full"
FAULTS = ("kill", "freeze", "kill", "stop")
"""The cycle: two rank losses (one crash, one silence) per whole-job stop."""
FENCE_WAIT_S = 10.0
"""How long a frozen rank may stay frozen before the soak takes its agent's fence for missing."""
STOP_WAIT_S = 120.0
"""How long a stopped launcher may take to commit and exit."""
HEARTBEAT_S = 1.0
GOAL = 0.95


STEPS_PER_EPOCH = 100


def recipe(run_dir: Path, epochs: int) -> str:
    """bench.live's recipe on the smoke CNN (BatchNorm) at 32 px, exact: `epochs` of STEPS_PER_EPOCH
    global steps of 16 samples, 2 micro-batches per rank at 4 ranks (a grid of 8), a checkpoint every 50
    steps (what a whole-job stop resumes from when nothing newer committed)."""
    return config_text(
        run_dir,
        heartbeat_timeout_s=HEARTBEAT_S,
        steps=STEPS_PER_EPOCH,
        epochs=epochs,
        rejoin=100,
        every_steps=50,
        exact=True,
        model="simple_cnn",
        width=4,
        image_size=32,
    )


def model_sha256(model_pt: Path) -> str:
    """SHA-256 over every tensor of a saved model, in key order (names and bytes)."""
    import torch

    state = torch.load(model_pt, weights_only=True, map_location="cpu")
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def launch(recipe_path: Path, world: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "launch.local", "--gpus", str(world), "--device", "cpu", "--config", str(recipe_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("ab") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


@dataclass
class Soak:
    code: int
    wall_s: float
    sha256: str | None
    faults: list[dict] = field(default_factory=list)
    log: str = ""


def _alive(pid: int) -> bool:
    """Running or stopped, not gone nor a zombie (base/procs reads /proc once: no race with its exit)."""
    return procs.state(pid) not in (None, "Z", "X")


def trained_step(run_dir: Path) -> int:
    """The newest global step any rank's heartbeat (RUN_DIR/progress/rank-N.json) reports, 0 before one."""
    newest = 0
    for path in (run_dir / "progress").glob("rank-*.json"):
        try:
            newest = max(newest, int(json.loads(path.read_text()).get("step") or 0))
        except (OSError, ValueError, AttributeError):
            continue  # being written
    return newest


def training_again(proc: subprocess.Popen[bytes], run_dir: Path, since: int, timeout_s: float) -> None:
    """Wait until a launch trains a step past `since`: faults are timed from training, not start-up (a
    rank lost while the first group forms fails the attempt: docs/live.md, limits)."""
    deadline = time.monotonic() + timeout_s
    while trained_step(run_dir) <= since and proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step trained within {timeout_s:.0f} s of a launch")
        time.sleep(0.05)


def _wait(proc: subprocess.Popen[bytes], seconds: float) -> int | None:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def deliver(kind: str, proc: subprocess.Popen[bytes], rng: random.Random) -> dict:
    """One fault; returns what was done (the stop's exit code, whether a freeze was fenced)."""
    ranks = rank_pids(proc.pid)
    if kind == "stop" or not ranks:
        started = time.time()
        proc.send_signal(signal.SIGTERM)
        code = _wait(proc, STOP_WAIT_S)
        return {"fault": "stop", "time": started, "code": code, "exit_s": round(time.time() - started, 2)}
    victim = rng.choice(sorted(ranks))
    if kind == "kill":
        os.kill(victim, signal.SIGKILL)
        return {"fault": "kill", "time": time.time(), "pid": victim}
    os.kill(victim, signal.SIGSTOP)
    started = time.time()
    deadline = time.monotonic() + FENCE_WAIT_S
    while _alive(victim) and time.monotonic() < deadline:
        time.sleep(0.05)
    fenced = not _alive(victim)
    if not fenced:
        os.kill(victim, signal.SIGKILL)
    return {
        "fault": "freeze",
        "time": started,
        "pid": victim,
        "fenced_s": round(time.time() - started, 2) if fenced else None,
    }


def soak(work: Path, epochs: int, world: int, every_s: float, seed: str, faults: bool, timeout_s: float) -> Soak:
    """One run of the recipe: with faults every `every_s` (cycle FAULTS), or none."""
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / ("faulted" if faults else "reference")
    path = work / f"{run_dir.name}.yaml"
    path.write_text(recipe(run_dir, epochs))
    log = work / f"{run_dir.name}.log"
    rng = random.Random(f"{seed}:soak")
    done: list[dict] = []
    started = time.monotonic()
    deadline = started + timeout_s
    size = world
    proc = launch(path, size, log)
    try:
        training_again(proc, run_dir, 0, STOP_WAIT_S)
        while True:
            code = _wait(proc, every_s if faults else max(1.0, deadline - time.monotonic()))
            if code is not None:
                if code == 75:  # a stop we did not send (a regroup below the minimum): resume as a scheduler would
                    done.append({"fault": "requeue", "time": time.time(), "code": code})
                    step = trained_step(run_dir)
                    proc = launch(path, size, log)
                    training_again(proc, run_dir, step, STOP_WAIT_S)
                    continue
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {run_dir.name} run did not finish within {timeout_s:.0f} s")
            if not faults:
                continue
            event = deliver(FAULTS[len(done) % len(FAULTS)], proc, rng)
            done.append(event)
            if event["fault"] == "stop":
                if event["code"] is None:
                    raise TimeoutError(f"the launcher did not exit within {STOP_WAIT_S:.0f} s of SIGTERM")
                if event["code"] == 0:
                    code = 0
                    break
                size = world - 1 if size == world else world
                event["resumed_on"] = size
                step = trained_step(run_dir)
                proc = launch(path, size, log)
                training_again(proc, run_dir, step, STOP_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - started
    model = run_dir / "model.pt"
    sha = model_sha256(model) if code == 0 and model.is_file() else None
    return Soak(code, wall, sha, done, log.read_text(errors="replace")[-4000:])


def run(
    minutes: float = 30.0, every_s: float = 30.0, world: int = 4, seed: str | None = None, keep: Path | None = None
) -> Result:
    """The reference is sized from a short timing run so that the faulted run lasts about `minutes`.
    `keep` (or SOAK_KEEP): the runs' folders and logs stay there (else a temporary folder, removed)."""
    seed = seed or os.environ.get("SOAK_SEED", "55")
    keep = keep or (Path(os.environ["SOAK_KEEP"]) if os.environ.get("SOAK_KEEP") else None)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = keep or Path(tmp)
        probe = soak(work / "probe", 2, world, every_s, seed, faults=False, timeout_s=600)
        if probe.code != 0:
            raise RuntimeError(f"the timing run failed ({probe.code}):\n{probe.log}")
        epochs = max(2, round(minutes * 60 / (probe.wall_s / 2)))
        steps = epochs * STEPS_PER_EPOCH
        reference = soak(work / "ref", epochs, world, every_s, seed, faults=False, timeout_s=minutes * 60 * 4 + 600)
        if reference.code != 0:
            raise RuntimeError(f"the reference run failed ({reference.code}):\n{reference.log}")
        faulted = soak(work / "chaos", epochs, world, every_s, seed, faults=True, timeout_s=minutes * 60 * 4 + 600)
    equal = faulted.sha256 is not None and faulted.sha256 == reference.sha256
    goodput = (steps / faulted.wall_s) / (steps / reference.wall_s)
    counts = {
        kind: sum(1 for f in faulted.faults if f["fault"] == kind) for kind in ("kill", "freeze", "stop", "requeue")
    }
    unfenced = sum(1 for f in faulted.faults if f["fault"] == "freeze" and f.get("fenced_s") is None)
    dishonest = [f["code"] for f in faulted.faults if f["fault"] == "stop" and f["code"] not in (0, 75)]
    notes = (
        f"{world} CPU ranks (launch.local --gpus {world} --device cpu, W <-> {world - 1} at each stop), {steps} steps "
        f"of 16 synthetic 32 px images, simple_cnn width 4 (BatchNorm), train.exact, recovery.live, "
        f"heartbeat bound {HEARTBEAT_S:g} s; a fault every {every_s:g} s: {counts['kill']} SIGKILLs, "
        f"{counts['freeze']} SIGSTOPs ({unfenced} not fenced by their agent), {counts['stop']} whole-job stops "
        f"resumed on another world size (their exits other than 75: {dishonest or 'none'}), {counts['requeue']} "
        f"other exits 75; final exit {faulted.code}; "
        f"model SHA-256 {'equal to' if equal else 'DIFFERENT from'} the fault-free run's "
        f"({(faulted.sha256 or 'none')[:16]} vs {(reference.sha256 or 'none')[:16]}); reference {reference.wall_s:.0f} s, "
        f"faulted {faulted.wall_s:.0f} s; load average {load_average()}; {world} ranks on {os.cpu_count()} cores: where "
        f"they outnumber the cores, a rank less runs the others faster, so a goodput above 1 says the faults cost "
        f"less than the oversubscription they relieve (a core per rank is the real measure)"
    )
    return Result(
        key="soak",
        title=f"Chaos soak: {world} live ranks, a fault every {every_s:g} s, exact bits: goodput ÷ the fault-free run",
        project=round(steps / faulted.wall_s, 3),
        baseline=round(steps / reference.wall_s, 3),
        unit="steps/s",
        ratio=round(goodput, 3) if equal and faulted.code == 0 and not unfenced and not dishonest else 0.0,
        goal=GOAL,
        higher_is_better=True,
        command=COMMAND,
        project_label="with faults",
        baseline_label="fault-free",
        notes=notes,
        extra={"faults": faulted.faults, "sha256_equal": equal, "steps": steps, "exit": faulted.code},
    )


def from_env(quick: bool = False) -> tuple[float, float]:
    """(minutes, every_s) for bench.run: SOAK_MINUTES and SOAK_EVERY_S, else the issue's 30 min and 30 s
    (2 min and 10 s with --quick)."""
    minutes = float(os.environ.get("SOAK_MINUTES") or (2 if quick else 30))
    every_s = float(os.environ.get("SOAK_EVERY_S") or (10 if quick else 30))
    return minutes, every_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the faulted run lasts, about")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--world", type=int, default=4, help="ranks (W; a stop resumes on W-1, the next on W)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs and their logs in this folder")
    args = parser.parse_args(argv)
    result = run(args.minutes, args.every, args.world, keep=args.keep)
    print(json.dumps(result.to_dict(), indent=1))
    return 0 if result.met else 1


if __name__ == "__main__":
    sys.exit(main())
