"""A stop is committed within the grace, whatever a step costs (issue #53): signal -> committed checkpoint.

    python -m bench.run --only stop_grace     # or: python -m bench.stop_grace [--quick]

Two figures, each on 2 CPU ranks under launch.local, SIGTERM to the launcher's PID (what a kubelet and
`docker stop` do), median of the rounds:

- `stop_grace_long`: steps of ~20 s (40 micro-batches whose forwards each sleep 0.5 s: the test model
  tests/programs/slow_model.py, standing for a slow model or accumulation), the signal right after step 1,
  so mid-step 2. Goal: committed within 5 s, a quarter of the step (the ranks drop the step in flight,
  core/step_drop.py). Before: the step, then the agreement two steps later (~60 s, past any grace).
- `stop_grace_smoke`: the smoke recipe (30 epochs, so that it is never done before the signal lands), the
  signal after step 4: what the change must leave as it was (0.3-0.8 s before it).
- `stop_grace_retrained`: the steps the same command trains again after the long-step stop: the step
  in flight at the signal less the step committed. Goal 1 (the dropped step); before: every step since
  the last periodic checkpoint.
- `stop_grace_docker` and `stop_grace_pod` (where a Docker engine answers, as root, with the project's
  image, TORCHLAUNCH_IMAGE or torchlaunch:dev): the long step's launch.local in a container, stopped by
  `docker stop` with its default 10 s, and as a pod's container (KUBERNETES_SERVICE_HOST and the grace
  launch.k8s renders, 30 s: Kubernetes' default) by `docker stop -t 30`, what a kubelet does on a pod
  deletion. Figure: seconds from `docker stop` to the container's exit 75, against the grace (a SIGKILL
  at the grace would be exit 137, and nothing committed after the step).

The signal -> commit figure is rank 0's own: its `preempted: checkpoint committed ... N s after the signal`
line, from the signal's arrival in the rank to the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import REPO, Result, median

COMMAND = "python -m bench.run --only stop_grace"
AFTER = re.compile(r"preempted: checkpoint committed at global step (\d+) in [\d.]+ s, ([\d.]+) s after the signal")
SLOW_FORWARD_S = 0.5
LONG_STEP_MICRO_BATCHES = 40


def argv(run_dir: Path, long_step: bool) -> list[str]:
    slow = ["model.name=tests.programs.slow_model:net", "train.micro_batch_size=2", "train.batch_size=160"]
    return [
        sys.executable, "-m", "torchlaunch.agent", "--gpus", "2", "--device", "cpu",
        "--config", "configs/smoke.yaml", f"run_dir={run_dir}", "checkpoint.every_steps=1000",
        *(slow if long_step else ["train.epochs=30"]),  # smoke: never done before the signal lands
    ]  # fmt: skip


def beat_step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "progress" / "rank-0.json").read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def one_stop(run_dir: Path, long_step: bool, at_step: int, timeout_s: float = 600) -> tuple[float, int]:
    """(seconds from the signal to the committed checkpoint as rank 0 measured them, steps the same command
    trains again: the step in flight at the signal less the step committed)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        TORCHLAUNCH_TEST_FORWARD_S=str(SLOW_FORWARD_S if long_step else 0),
    )
    proc = subprocess.Popen(
        argv(run_dir, long_step), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + timeout_s
        while (done := beat_step(run_dir)) < at_step:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the launch ended or stalled before step {at_step}")
            time.sleep(0.05)  # polling another process's heartbeat file: there is no event for a step
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    found = AFTER.search((run_dir / "logs" / "rank-0.log").read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"no committed checkpoint after the signal in {run_dir}")
    return float(found[2]), done + 1 - int(found[1])


IMAGE = os.environ.get("TORCHLAUNCH_IMAGE", "torchlaunch:dev")
DOCKER = os.environ.get("DOCKER", "/usr/bin/docker")
POD_GRACE_S = 30


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False)


def docker_ready() -> str | None:
    """Why the container rows cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root (the shared folder is handed to the image's user)"
    if not Path(DOCKER).exists() or docker("info", timeout=20).returncode != 0:
        return "no Docker engine answers"
    if docker("image", "inspect", IMAGE).returncode != 0:
        return f"no image {IMAGE} (make image)"
    return None


def one_container_stop(work: Path, pod: bool, timeout_s: float = 600) -> float:
    """Seconds from `docker stop` to the container's exit 75: the long-step launch in the image, stopped
    mid step 2 with docker's default 10 s, or as a pod's container with its 30 s (`pod`)."""
    from torchlaunch.backends.k8s.hardening import RUN_AS

    shared = work / "shared"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    os.chown(shared, RUN_AS, RUN_AS)
    name = f"tl-bench-stop-{uuid.uuid4().hex[:8]}"
    model = REPO / "tests" / "programs" / "slow_model.py"
    env = ["-e", "OMP_NUM_THREADS=1", "-e", "PYTHONPATH=/code", "-e", f"TORCHLAUNCH_TEST_FORWARD_S={SLOW_FORWARD_S}"]
    if pod:  # what the kubelet and the rendered manifest give a pod's container
        env += ["-e", "KUBERNETES_SERVICE_HOST=10.0.0.1", "-e", f"TORCHLAUNCH_GRACE_S={POD_GRACE_S}"]
    command = argv(Path("/shared/run"), True)[1:]  # -m torchlaunch.agent ...
    run = ["run", "-d", "--name", name, "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--shm-size", "256m"]
    run += ["-v", f"{shared}:/shared", "-v", f"{model}:/code/tests/programs/slow_model.py:ro", *env]
    started = docker(*run, IMAGE, "python", *command)
    if started.returncode != 0:
        raise RuntimeError(f"docker run: {started.stderr.strip()[-500:]}")
    try:
        deadline = time.monotonic() + timeout_s
        while beat_step(shared / "run") < 1:
            if (
                time.monotonic() > deadline
                or "running" not in docker("inspect", "-f", "{{.State.Status}}", name).stdout
            ):
                raise RuntimeError(
                    f"the container ended or stalled before step 1: {docker('logs', name).stderr[-800:]}"
                )
            time.sleep(0.1)  # polling the shared folder: there is no event for a step
        grace_s = POD_GRACE_S if pod else 10
        start = time.monotonic()
        docker("stop", *(["-t", str(grace_s)] if pod else []), name, timeout=grace_s + 60)
        took = time.monotonic() - start
        code = docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        if code != "75":
            raise RuntimeError(f"exit {code} after docker stop ({took:.1f} s): {docker('logs', name).stderr[-800:]}")
        return took
    finally:
        docker("rm", "-f", name)


def run(quick: bool = False, rounds: int = 3) -> list[Result]:
    rounds = 1 if quick else rounds
    work = Path(tempfile.mkdtemp(prefix="bench-stop-grace-"))
    step_s = SLOW_FORWARD_S * LONG_STEP_MICRO_BATCHES
    try:
        long_runs = [one_stop(work / f"long-{i}", True, 1) for i in range(rounds)]
        smoke = [one_stop(work / f"smoke-{i}", False, 4)[0] for i in range(rounds)]
        why_not = docker_ready()
        containers = {} if why_not else {pod: one_container_stop(work / "container", pod) for pod in (False, True)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    long = [seconds for seconds, _ in long_runs]
    again = [float(steps) for _, steps in long_runs]
    if why_not:
        print(f"stop_grace: the docker stop and pod rows not measured: {why_not}", file=sys.stderr)
    rows = [
        Result(
            key=f"stop_grace_{'pod' if pod else 'docker'}",
            title=f"{'Pod deletion (30 s grace)' if pod else 'docker stop (10 s default)'} -> exit 75, ~20 s steps, "
            "2 CPU ranks in one container (s ÷ the grace)",
            project=took,
            baseline=float(POD_GRACE_S if pod else 10),
            unit="s",
            ratio=took / (POD_GRACE_S if pod else 10),
            goal=1.0,
            higher_is_better=False,
            command=COMMAND,
            project_label="the step in flight dropped, committed, exit 75",
            baseline_label="the grace (SIGKILL: exit 137, the steps since the last checkpoint lost)",
            rounds=[took],
            notes=f"image {IMAGE}; `docker stop{' -t 30' if pod else ''}` once rank 0's heartbeat says step 1; "
            + ("KUBERNETES_SERVICE_HOST and TORCHLAUNCH_GRACE_S=30 as the rendered pod has; " if pod else "")
            + "1 round",
        )
        for pod, took in containers.items()
    ]
    return [
        Result(
            key="stop_grace_long",
            title="Signal -> committed checkpoint, SIGTERM mid-step, ~20 s steps, 2 CPU ranks (s ÷ the step)",
            project=median(long),
            baseline=step_s,
            unit="s",
            ratio=median(long) / step_s,
            goal=0.25,
            higher_is_better=False,
            command=COMMAND,
            project_label="the step in flight dropped (core/step_drop.py)",
            baseline_label="one step (the least a stop that waits for the step costs)",
            rounds=long,
            notes=f"{LONG_STEP_MICRO_BATCHES} micro-batches of 2 samples per rank, each forward sleeping "
            f"{SLOW_FORWARD_S} s (tests/programs/slow_model.py); SIGTERM to the launcher once rank 0's heartbeat "
            f"says step 1; rank 0's own figure; {rounds} rounds",
        ),
        Result(
            key="stop_grace_smoke",
            title="Signal -> committed checkpoint, the smoke recipe, 2 CPU ranks (s ÷ 1 s)",
            project=median(smoke),
            baseline=1.0,
            unit="s",
            ratio=median(smoke),
            goal=1.0,
            higher_is_better=False,
            command=COMMAND,
            project_label="configs/smoke.yaml",
            baseline_label="1 s (0.3-0.8 s before issue #53)",
            rounds=smoke,
            notes=f"SIGTERM to the launcher once rank 0's heartbeat says step 4; rank 0's own figure; {rounds} rounds",
        ),
        Result(
            key="stop_grace_retrained",
            title="Steps trained again after a SIGTERM mid-step, ~20 s steps, 2 CPU ranks (steps ÷ 1)",
            project=max(again),
            baseline=1.0,
            unit="steps",
            ratio=max(again),
            goal=1.0,
            higher_is_better=False,
            command=COMMAND,
            project_label="the step in flight at the signal less the step committed",
            baseline_label="the one step in flight (before: every step since the last periodic checkpoint)",
            rounds=again,
            notes=f"the stop_grace_long rounds; the most of {rounds}",
        ),
        *rows,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of each")
    args = parser.parse_args()
    for r in run(quick=args.quick):
        print(f"{r.key}: {r.project:.2f} {r.unit} (rounds {', '.join(f'{v:.2f}' for v in r.rounds)}); {r.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
