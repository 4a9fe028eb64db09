"""test_outside_stops_schedulers: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/integration/test_outside_stops_local.py.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.engines.test_docker_job import image, make_job  # noqa: F401 - fixtures, for the container cases
from tests.engines.test_slurm_cluster import cluster  # noqa: F401 - the dev cluster fixture, for the Slurm cases
from tests.helpers import assert_models_equal
from tests.integration.test_outside_stops_local import (  # noqa: F401 (fixtures, used by name)
    LONG_STEP_MAX_S,
    SLURM_CASES,
    committed_after_signal,
    folders,
    long_step_overrides,
    long_step_reference,
    shards,
)
from torchlaunch import contract
from torchlaunch.exit_codes import OK, PREEMPTED

pytestmark = pytest.mark.slow


@pytest.mark.slurm
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("cluster")
@pytest.mark.parametrize(
    "scancel",
    [pytest.param(c, id=" ".join(c), marks=[pytest.mark.extended] if "--full" in c else []) for c in SLURM_CASES],
)  # --full in CI: every process of a job signalled, the job requeued once and resumed exactly is test_live_slurm.py's
# whole job preempted from outside; the step in flight dropped, with the stop passed on by the batch shell: --batch
def test_slurm_stop_from_outside_mid_step_requeues_and_resumes_exactly(
    scancel: tuple[str, ...], shards: Path, tmp_path: Path, tmp_path_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 nodes x 1 task on shards with 2 loader workers per rank, steps of ~8 s (issue #53); the stop is
    delivered by scancel mid-step: the step in flight is dropped, the last finished one committed within
    seconds, the job requeued once and its resumed run is the uninterrupted one bit for bit.
    On 9d2744e: `--signal=TERM` failed 1 in 2 tries (a worker's death raced the rank's stop); `--full`
    and `--batch` ended the job (the batch shell died of the signal), never requeued."""
    from tests.engines.test_slurm_cluster import Launch as SlurmLaunch
    from tests.engines.test_slurm_cluster import requeue_records, slurm, wait_until

    expected = long_step_reference(shards, tmp_path_factory)
    # sbatch passes the submitter's environment on, and the requeued job keeps it: the seconds are in a file
    forward_s = tmp_path / "forward_s"
    forward_s.write_text("0.5")
    monkeypatch.setenv("TORCHLAUNCH_TEST_FORWARD_S", f"@{forward_s}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_dir = tmp_path / "run"
    args = ["--config", "configs/smoke.yaml", *long_step_overrides(str(shards))]
    launch = SlurmLaunch(run_dir, "--nodes", "2", "--tasks-per-node", "1", "--time", "30", *args)
    wait_until(lambda: beat_step(run_dir) >= 1, 240, "the first step")  # step 2 has ~8 s of micro-batches ahead
    slurm("scancel", *scancel, launch.job_id)
    forward_s.write_text("0")  # the ranks stopped have their model; the resumed ones train fast (same numbers)
    wait_until(lambda: "REQUEUED" in requeue_records(launch.job_id), 120, "the requeue")
    assert launch.finish(300) == OK, launch.text()[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "slurm" / launch.job_id).glob("*_log.*"))
    assert "DataLoader worker" not in logs, logs[-3000:]
    assert requeue_records(launch.job_id) == ["REQUEUED", "COMPLETED"]  # requeued exactly once
    log = (run_dir / "logs" / "rank-0.log").read_text()
    step, after = committed_after_signal(log)
    assert step >= 1 and f"stop: dropped step {step + 1} in flight; committing step {step}" in log, log[-3000:]
    assert after <= LONG_STEP_MAX_S, log[-3000:]
    assert "resumed from" in log and f"step-{step:09d}" in log, log[-3000:]
    print(f"slurm {' '.join(scancel)}: step {step} committed {after} s after the signal")
    assert_models_equal(run_dir / "model.pt", expected)


def beat_step(run_dir: Path) -> int:
    """Rank 0's step as its heartbeat says (0 before it has one)."""
    try:
        return int(json.loads((run_dir / "progress" / "rank-0.json").read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def rank_stacks(docker: Callable[..., Any], name: str, progress: Path) -> str:
    """Every rank's Python stacks from inside the container, for a failure message: each rank named its
    dump signal in its heartbeat (jobs/progress.py) and writes its stacks to rank-N.stack on it."""
    for beat_file in sorted(progress.glob("rank-*.json")):
        beat = json.loads(beat_file.read_text(errors="replace") or "{}")
        if isinstance(beat.get("pid"), int) and isinstance(beat.get("dump_signal"), int):
            kill = f"import os; os.kill({beat['pid']}, {beat['dump_signal']})"
            docker("exec", name, "python", "-c", kill, check=False)
    stacks = sorted(progress.glob("rank-*.stack"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(p.stat().st_size for p in stacks):
        time.sleep(0.2)  # the dumps land asynchronously; bounded
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in stacks)


def long_step_container(shards: Path, tmp_path: Path, forward_s: float) -> list[str]:
    """`docker run` options for the long-step recipe in the image: the shards at /data (read-only, as the
    image's user reads them), the test model (not in the image) on PYTHONPATH, and its forward's sleep."""
    data = tmp_path / "data"
    if not data.exists():
        shutil.copytree(shards, data)
        for path in [data, *data.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    model = REPO / "tests" / "programs" / "slow_model.py"
    return [
        "-v", f"{data}:/data:ro", "-v", f"{model}:/code/tests/programs/slow_model.py:ro", "-e", "PYTHONPATH=/code",
        "-e", f"TORCHLAUNCH_TEST_FORWARD_S={forward_s:g}", "-e", "OMP_NUM_THREADS=1",
    ]  # fmt: skip


@pytest.mark.docker
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("image")
def test_docker_stop_mid_long_step_commits_within_its_default_grace_and_resumes_exactly(
    shards: Path, tmp_path: Path, tmp_path_factory
) -> None:
    """Issue #53: `docker stop` with its default 10 s (SIGTERM to PID 1, SIGKILL 10 s later) in the middle
    of an ~8 s step, 2 ranks on shards with loader workers: the step in flight is dropped, the last finished
    one committed and the container exits 75 before the SIGKILL; the same command resumes to the
    uninterrupted run's weights."""
    from tests.engines.test_docker_job import IMAGE, docker, shared_folder

    expected = long_step_reference(shards, tmp_path_factory)
    shared = shared_folder(tmp_path / "shared")
    command = ["python", "-m", "launch.local", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml"]
    command += [*long_step_overrides("/data"), "run_dir=/shared/run"]
    name = f"tl-longstop-{tmp_path.name[-12:].lower()}".replace("_", "-")
    run = ["run", "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--shm-size", "256m"]
    run += ["-v", f"{shared}:/shared"]
    docker(*run, "--name", name, *long_step_container(shards, tmp_path, 0.5), "-d", IMAGE, *command)
    run_dir = shared / "run"
    try:
        deadline = time.monotonic() + 300
        while beat_step(run_dir) < 1:
            if time.monotonic() >= deadline:
                stderr = docker("logs", name, check=False).stderr[-3000:]
                pytest.fail(f"no step within 300 s\n{stderr}\n{rank_stacks(docker, name, run_dir / 'progress')}")
            time.sleep(0.1)  # polling the shared volume, bounded by the deadline
        start = time.monotonic()
        docker("stop", name, timeout=60)  # docker's default grace: 10 s
        took = time.monotonic() - start
        code = int(docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip())
        logs = docker("logs", name, check=False)
        assert code == PREEMPTED, logs.stderr[-3000:]
        assert took < 10, took  # ended by its own checkpoint and exit, not by the SIGKILL
        assert "DataLoader worker" not in logs.stderr and "Traceback" not in logs.stderr, logs.stderr[-3000:]
    finally:
        docker("rm", "-f", name, check=False)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    step, after = committed_after_signal(log)
    assert step >= 1 and f"stop: dropped step {step + 1} in flight" in log, log[-3000:]
    assert (run_dir / "checkpoints" / f"step-{step:09d}" / "COMMITTED.json").exists()
    print(f"docker stop (10 s): step {step} committed {after} s after the signal, exit 75 after {took:.1f} s")
    docker(*run, "--rm", *long_step_container(shards, tmp_path, 0), IMAGE, *command, timeout=600)
    assert_models_equal(run_dir / "model.pt", expected)


@pytest.mark.docker
@pytest.mark.timeout(900)
def test_pod_deleted_mid_long_step_commits_within_the_default_grace_and_the_job_resumes_exactly(
    make_job, shards: Path, tmp_path: Path, tmp_path_factory
) -> None:
    """Issue #53: a pod deletion with Kubernetes' default 30 s grace (the kubelet's SIGTERM, SIGKILL at the
    end of terminationGracePeriodSeconds, which the manifest leaves at its default) in the middle of an
    ~8 s step; the Job's two pods run as containers under the Job controller's stand-in
    (tests/engines/test_docker_job.py). The rendezvous host's pod is deleted: its rank drops the step, its
    peer at its next micro-batch (the word is in the store), the last finished step is committed within
    seconds, and the replaced pods resume to the uninterrupted run."""
    from tests.engines.test_docker_job import docker

    expected = long_step_reference(shards, tmp_path_factory)
    overrides = [*long_step_overrides("/data"), "preemption.lead_time_s=30"]
    dj = make_job("longstop", *overrides, extra=long_step_container(shards, tmp_path, 0.5))
    # A manifest that leaves the grace to Kubernetes: its 30 s default, which the pod's launcher assumes.
    dj.pod["terminationGracePeriodSeconds"] = 30
    container = dj.pod["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != contract.GRACE]
    running = dj.start_all()
    deadline = time.monotonic() + 300
    while beat_step(dj.run_dir) < 1:
        assert time.monotonic() < deadline, f"no step within 300 s:\n{dj.logs(0)[-3000:]}"
        time.sleep(0.1)  # polling the shared volume, bounded by the deadline
    start = time.monotonic()
    docker("stop", "-t", str(dj.grace_s), dj.container(0), timeout=dj.grace_s + 30)
    took = time.monotonic() - start
    status, code = dj.state(0)
    assert (status, code) == ("exited", PREEMPTED), f"took {took:.1f}s:\n{dj.logs(0)[-3000:]}"
    assert took < dj.grace_s, took  # not SIGKILLed at the end of the grace period
    log = (dj.run_dir / "logs" / "rank-0.log").read_text()
    step, after = committed_after_signal(log)
    assert step >= 1 and f"stop: dropped step {step + 1} in flight" in log, log[-3000:]
    assert after <= LONG_STEP_MAX_S, log[-3000:]  # the peer left at its next micro-batch, not the step's end
    print(f"pod deletion (30 s): step {step} committed {after} s after the signal, pod exit 75 after {took:.1f} s")
    dj.extra = long_step_container(shards, tmp_path, 0)  # the replaced pods train fast (the same numbers)
    dj.run_until_complete(running)
    assert dj.failures == 0, f"a preemption must not count against backoffLimit: {dj.history}"
    log = (dj.run_dir / "logs" / "rank-0.log").read_text()
    assert f"step-{step:09d}" in log.split("resumed from", 1)[-1], log[-3000:]
    assert_models_equal(dj.run_dir / "model.pt", expected)
