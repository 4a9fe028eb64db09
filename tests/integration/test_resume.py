"""Exact resume (issue 3): interrupted-and-resumed runs end bit for bit where uninterrupted runs end.

Real torchrun with 2 CPU ranks on gloo. Interruptions use the real signal path: either SIGTERM to the
launcher from outside, or TORCHLAUNCH_FAULT_SIGNAL, which makes one rank signal itself at an exact
point (after a step, during validation, right after a save) so every case is reproducible.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import launcher_argv
from tests.helpers import REPO, assert_models_equal, assert_states_equal, final_state, launcher
from tests.library import RunLibrary

pytestmark = pytest.mark.slow

# 1024 samples / batch 64 = 16 steps per epoch, 3 epochs = 48 steps; checkpoints every 5 steps.
SMALL = [
    "data.synthetic_train_size=1024",
    "data.synthetic_val_size=300",
    "train.batch_size=64",
    "train.epochs=3",
    "checkpoint.every_steps=5",
    "train.log_every_steps=4",
    "debug.trace_batches=true",
]
STEPS_PER_EPOCH = 16
TOTAL_STEPS = 48


def run(
    run_dir: Path, gpus: int = 2, extra: list[str] = (), env: dict | None = None, restarts: int = 0
) -> subprocess.CompletedProcess:
    args = [
        "--gpus",
        str(gpus),
        "--max-restarts",
        str(restarts),
        "--config",
        "configs/smoke.yaml",
        f"run_dir={run_dir}",
        *SMALL,
        "recovery.live=false",  # the subject: the restart road's resume from a checkpoint, bit for bit
        *extra,
    ]
    return launcher(args, env=env)


@pytest.fixture(scope="module")
def reference(run_library: RunLibrary) -> Path:
    """The uninterrupted 2-rank run of SMALL: the session's library entry "resume" (read only; its exit
    code is asserted where it is built, tests/library.py), shared with test_preempt_last_step.py."""
    return run_library.path("resume")


def global_batches(run_dir: Path) -> dict[int, list[int]]:
    """step -> sorted union of every rank's sample indices (from the batch trace)."""
    steps: dict[int, list[int]] = {}
    for f in (run_dir / "trace").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            steps.setdefault(rec["step"], []).extend(rec["indices"])
    return {k: sorted(v) for k, v in steps.items()}


seeded = random.Random(1234)
INTERRUPTIONS = [
    ("step", seeded.randrange(1, STEPS_PER_EPOCH - 1), 0),  # mid-epoch, seeded
    ("step", STEPS_PER_EPOCH + seeded.randrange(1, STEPS_PER_EPOCH - 1), 1),  # mid-epoch, other rank
    ("step", STEPS_PER_EPOCH, 1),  # last step of an epoch
    ("val", 1, 0),  # during validation of epoch 2
    ("save", 10, 1),  # right after a save
]


@pytest.mark.parametrize(
    "at,n,rank",
    [
        # a second mid-epoch stop (on the other rank) is the extended tier's; CI's: one of each phase
        pytest.param(*case, id=f"{case[0]}{case[1]}-rank{case[2]}", marks=[pytest.mark.extended] if i == 1 else [])
        for i, case in enumerate(INTERRUPTIONS)
    ],
)
def test_signal_then_rerun_equals_uninterrupted(tmp_path: Path, reference: Path, at: str, n: int, rank: int) -> None:
    first = run(tmp_path, env={"TORCHLAUNCH_FAULT_SIGNAL": f"at={at},n={n},rank={rank}"})
    assert first.returncode == 75, first.stderr[-2000:]
    assert "preempted: checkpoint committed" in first.stdout + first.stderr
    second = run(tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout + second.stderr
    assert_states_equal(final_state(reference), final_state(tmp_path))
    assert_models_equal(reference / "model.pt", tmp_path / "model.pt")
    assert global_batches(tmp_path) == global_batches(reference)


def sigterm_launcher_mid_run(run_dir: Path, gpus: int) -> None:
    """Start launch.local, send SIGTERM to it once rank 0 has logged 3 metrics lines, expect exit 75."""
    args = launcher_argv(
        "torchlaunch.agent",
        "--gpus",
        str(gpus),
        "--config",
        "configs/smoke.yaml",
        f"run_dir={run_dir}",
        *SMALL,
    )
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "run ended or stalled before the signal"
        time.sleep(0.05)  # polling a file written by another process; the assertion above bounds it
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:]


@pytest.mark.extended  # SIGTERM to the launcher's PID, then an exact rerun: test_outside_stops_local.py, in CI's tier
def test_external_sigterm_to_launcher(tmp_path: Path, reference: Path) -> None:
    sigterm_launcher_mid_run(tmp_path, gpus=2)
    second = run(tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert_models_equal(reference / "model.pt", tmp_path / "model.pt")


def test_one_worker_runs_without_the_agent_and_resumes_exactly(tmp_path: Path) -> None:
    """--gpus 1 without restarts starts the worker directly (no torchrun): signal forwarding, exit 75
    and the rerun's exact resume must be what they are under torchrun."""
    reference = tmp_path / "reference"
    done = run(reference, gpus=1)
    assert done.returncode == 0, done.stderr[-2000:]
    launch_line = next(ln for ln in done.stderr.splitlines() if ln.startswith("launch: "))
    assert "torchrun" not in launch_line and " -m torchlaunch.runner -m torchlaunch.worker --config " in launch_line
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    sigterm_launcher_mid_run(resumed, gpus=1)
    second = run(resumed, gpus=1)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout + second.stderr
    assert_states_equal(final_state(reference), final_state(resumed))
    assert_models_equal(reference / "model.pt", resumed / "model.pt")


def test_kill_9_of_one_rank_restarts_group_and_matches(tmp_path: Path, reference: Path) -> None:
    env = {"TORCHLAUNCH_FAULT_SIGNAL": "at=step,n=12,rank=1,sig=SIGKILL"}
    done = run(tmp_path, env=env, restarts=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    assert_states_equal(final_state(reference), final_state(tmp_path))


@pytest.mark.parametrize(
    "before,after",
    # 2 -> 1 is the extended tier's: CI's test_exact.py resumes 2 -> 3 bit-exact against the 1-rank run
    [pytest.param(2, 1, marks=pytest.mark.extended), (1, 2)],
)
def test_world_size_change_continues_global_order(tmp_path: Path, reference: Path, before: int, after: int) -> None:
    first = run(tmp_path, gpus=before, env={"TORCHLAUNCH_FAULT_SIGNAL": "at=step,n=21,rank=0"})
    assert first.returncode == 75, first.stderr[-2000:]
    second = run(tmp_path, gpus=after)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout + second.stderr
    assert global_batches(tmp_path) == global_batches(reference)  # same samples in every global step
    state = final_state(tmp_path)
    assert state["progress"]["global_step"] == TOTAL_STEPS and state["world_size"] == after


def test_kill_9_mid_checkpoint_write_then_rerun_matches(tmp_path: Path, reference: Path) -> None:
    """The whole job dies (SIGKILL to every process) while rank 0 is provably inside a save."""
    args = launcher_argv(
        "torchlaunch.agent",
        "--gpus",
        "2",
        "--config",
        "configs/smoke.yaml",
        f"run_dir={tmp_path}",
        *SMALL,
    )
    env = {**os.environ, "TORCHLAUNCH_FAULT_SAVE_STALL_S": "600", "TORCHLAUNCH_FAULT_SAVE_STALL_FROM_STEP": "15"}
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    ckpts = tmp_path / "checkpoints"
    deadline = time.monotonic() + 180
    try:
        while not list(ckpts.glob(".tmp-step-*/STALLING")):
            assert proc.poll() is None and time.monotonic() < deadline, "never reached a checkpoint write"
            time.sleep(0.05)  # polling another process's files; bounded by the deadline above
        in_progress = next(ckpts.glob(".tmp-step-*"))
        assert (in_progress / "state.pt").is_file()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert final_state(tmp_path)["progress"]["global_step"] == 10  # the previous checkpoint is intact
    second = run(tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert not in_progress.exists()  # the half-written save was discarded, never loaded
    assert "resumed from" in second.stdout + second.stderr and "step-000000010" in second.stdout + second.stderr
    assert_models_equal(reference / "model.pt", tmp_path / "model.pt")


@pytest.mark.extended  # more than two ranks resume bit for bit in CI's tier too (test_resume_uneven.py, 2 -> 3)
def test_four_ranks_resume_bit_for_bit(tmp_path_factory) -> None:
    """With more than two ranks a ring all-reduce's summation order depends on DDP's bucket layout,
    which differs in the first step after a restart; the rank-ordered gradient sum makes it exact."""
    reference = tmp_path_factory.mktemp("reference4")
    done = run(reference, gpus=4)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = tmp_path_factory.mktemp("resumed4")
    first = run(resumed, gpus=4, env={"TORCHLAUNCH_FAULT_SIGNAL": "at=step,n=27,rank=3"})
    assert first.returncode == 75, first.stderr[-2000:]
    second = run(resumed, gpus=4)
    assert second.returncode == 0, second.stderr[-2000:]
    assert_states_equal(final_state(reference), final_state(resumed))
    assert_models_equal(reference / "model.pt", resumed / "model.pt")
