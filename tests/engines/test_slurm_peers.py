"""Lightning and Accelerate scripts, unmodified, on the dev Slurm cluster (2 nodes x 1 task) with the peers
venv as the task interpreter (`--python`): they train, and preempted mid-run they are requeued and resume
from the framework's own checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv
from tests.engines.test_slurm_cluster import DEV_CLUSTER, requeue_records, slurm, wait_until

pytestmark = pytest.mark.slurm

PEERS = Path(os.environ.get("TORCHLAUNCH_PEERS_PYTHON", REPO / "bench" / ".venv-peers" / "bin" / "python"))


@pytest.fixture(scope="module")
def cluster() -> str:
    if not PEERS.exists():
        pytest.skip(f"no peers venv at {PEERS} (bench: make peers-venv)")
    if subprocess.run(["bash", str(DEV_CLUSTER), "status"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("the Slurm dev cluster is not up (slurm/dev-cluster.sh up)")
    os.environ["SLURM_CONF"] = "/tmp/slurm-dev/etc/slurm.conf"
    out = subprocess.run(["bash", str(DEV_CLUSTER), "env"], capture_output=True, text=True, timeout=60).stdout
    os.environ["SLURM_CONF"] = out.strip().split("SLURM_CONF=", 1)[1].split()[0]
    return os.environ["SLURM_CONF"]


def submit(run_dir: Path, program: str, *args: str) -> subprocess.Popen:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = launcher_argv("launch.slurm", "--nodes", "2", "--tasks-per-node", "1", "--time", "20")
    argv += ["--python", str(PEERS), "--run-dir", str(run_dir), "--wait", "--", program, str(run_dir), *args]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as out:
        return subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=subprocess.STDOUT
        )


def finished(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> tuple[int, str]:
    log = run_dir.parent / f"{run_dir.name}.log"
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"launcher did not return in {timeout_s} s:\n{log.read_text()[-3000:]}") from None
    return code, log.read_text()


def job_id(text: str) -> str:
    return text.split("submitted job ", 1)[1].split(":", 1)[0]


PROGRAMS = {
    "lightning": ("tests/programs/lightning_ddp.py", "global_step", 6 * 40 * 4 // 2),
    "accelerate": ("tests/programs/accelerate_train.py", "step", None),
}
TRAINS = ["accelerate", pytest.param("lightning", marks=pytest.mark.extended)]
# Lightning preempted on Slurm (45 s, most of it its import) is the extended tier's; CI preempts Accelerate
# here and Lightning under launch.local (tests/integration/test_dropin_torchrun.py).
PREEMPTED = ["accelerate", pytest.param("lightning", marks=pytest.mark.extended)]
"""Both frameworks run in CI's tier, each once: Accelerate trains on two nodes, Lightning is preempted,
requeued and resumed; the other two pairings are the extended tier's."""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", TRAINS)
def test_peer_framework_trains_on_two_nodes(cluster: str, tmp_path: Path, name: str) -> None:
    program, key, steps = PROGRAMS[name]
    run_dir = tmp_path / name
    code, text = finished(submit(run_dir, program), run_dir, 300)
    assert code == 0, text[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["resumed"] is False and result[key] > 0
    if steps is not None:
        assert result[key] == steps  # 6 epochs of 160 batches shared by 2 ranks
    assert requeue_records(job_id(text)) == ["COMPLETED"]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", PREEMPTED)
def test_peer_framework_preempted_is_requeued_and_resumes(cluster: str, tmp_path: Path, name: str) -> None:
    program, key, _ = PROGRAMS[name]
    run_dir = tmp_path / name
    proc = submit(run_dir, program, "--epochs", "40")
    saved = run_dir / ("ckpt/last.ckpt" if name == "lightning" else "state")
    wait_until(saved.exists, 240, f"{name}'s own checkpoint")
    slurm("sbatch", "-p", "high", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1")
    code, text = finished(proc, run_dir, 400)
    assert code == 0, text[-3000:]
    states = requeue_records(job_id(text))
    # Requeued (once, or again when the requeued job is scheduled before the preemptor and preempted
    # while its framework is still importing), then finished.
    assert states[0] == "REQUEUED" and states[-1] == "COMPLETED" and set(states[:-1]) == {"REQUEUED"}, states
    result = json.loads((run_dir / "result.json").read_text())
    assert result["resumed"] is True and result[key] > 0


@pytest.mark.timeout(500)
@pytest.mark.extended  # the runner stopping a handler-less program: test_dropin_torchrun.py, in CI's tier
def test_trainer_script_without_a_handler_is_stopped_by_the_runner_and_requeued(cluster: str, tmp_path: Path) -> None:
    """A real `Trainer` script installs no signal handler and forks DataLoader workers. submitit's
    handler used to run in the rank and in the workers (`A temporary saved file already exists`, a
    worker exiting 255, `preemptions 0`); now the runner owns the signal: the task says what happened
    and how Trainer resumes, is requeued once, and the script's own resume finishes the run."""
    run_dir = tmp_path / "trainer"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = launcher_argv("launch.slurm", "--nodes", "1", "--tasks-per-node", "1", "--time", "20")
    argv += ["--python", str(PEERS), "--run-dir", str(run_dir), "--wait", "--"]
    argv += ["tests/programs/trainer_train.py", str(run_dir), "--steps", "60"]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=subprocess.STDOUT
        )
    step = run_dir / "step"
    wait_until(lambda: step.exists() and int(step.read_text() or 0) >= 7, 240, "the Trainer's first checkpoint")
    slurm("sbatch", "-p", "high", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1")
    code, text = finished(proc, run_dir, 400)
    assert code == 0, text[-3000:]
    states = requeue_records(job_id(text))
    assert states[0] == "REQUEUED" and states[-1] == "COMPLETED", states
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "slurm" / job_id(text)).glob("*_log.*"))
    assert "had no SIG" in logs and "handler and was stopped by it" in logs, logs[-3000:]
    assert "resume_from_checkpoint=True" in logs, logs[-3000:]
    assert "A temporary saved file already exists" not in logs and "exited unexpectedly" not in logs, logs[-3000:]
    assert "preemptions 1" in logs, logs[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result == {"resumed": True, "global_step": 60}
