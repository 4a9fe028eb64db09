"""test_outside_stops: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/integration/test_outside_stops.py.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engines.test_docker_job import image  # noqa: F401 - the image fixture, for the container case
from tests.engines.test_slurm_cluster import cluster  # noqa: F401 - the dev cluster fixture, for the Slurm cases
from tests.helpers import assert_models_equal
from tests.integration.test_outside_stops import EPOCHS, SLURM_CASES, data_args, folders, reference, shards, weights  # noqa: F401 (fixtures, used by name)
from torchlaunch.exit_codes import OK, PREEMPTED

pytestmark = pytest.mark.slow


@pytest.mark.slurm
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("cluster")
@pytest.mark.parametrize("scancel", SLURM_CASES, ids=[" ".join(c) for c in SLURM_CASES])
def test_slurm_stop_from_outside_requeues_and_resumes_exactly(
    scancel: tuple[str, ...], folders: Path, shards: Path, tmp_path: Path, tmp_path_factory
) -> None:
    """2 nodes x 1 task on shards with 2 loader workers per rank; the stop is delivered by scancel.
    On 9d2744e: `--signal=TERM` failed 1 in 2 tries (a worker's death raced the rank's stop); `--full`
    and `--batch` ended the job (the batch shell died of the signal), never requeued."""
    from tests.engines.test_slurm_cluster import Launch as SlurmLaunch
    from tests.engines.test_slurm_cluster import requeue_records, slurm, wait_until

    expected = reference("shards", folders, shards, tmp_path_factory)
    run_dir = tmp_path / "run"
    args = ["--config", "configs/smoke.yaml", "data.image_size=32", "train.batch_size=32", f"train.epochs={EPOCHS}"]
    args += ["checkpoint.every_steps=1000", *data_args("shards", folders, shards)]
    launch = SlurmLaunch(run_dir, "--nodes", "2", "--tasks-per-node", "1", "--time", "30", *args)
    beat = run_dir / "progress" / "rank-0.json"
    wait_until(lambda: beat.exists() and '"step": ' in beat.read_text(), 240, "the first step")
    slurm("scancel", *scancel, launch.job_id)
    wait_until(lambda: "REQUEUED" in requeue_records(launch.job_id), 120, "the requeue")
    assert launch.finish(300) == OK, launch.text()[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "slurm" / launch.job_id).glob("*_log.*"))
    assert "DataLoader worker" not in logs, logs[-3000:]
    assert requeue_records(launch.job_id) == ["REQUEUED", "COMPLETED"]  # requeued exactly once
    assert_models_equal(run_dir / "model.pt", expected)


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


@pytest.mark.docker
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("image")
def test_docker_stop_of_a_container_with_loader_workers_resumes_exactly(
    folders: Path, shards: Path, tmp_path: Path, tmp_path_factory
) -> None:
    """The pod's path: `docker stop -t GRACE` sends SIGTERM to PID 1 (tini, then launch.local) and
    SIGKILL after the grace period. With 2 ranks reading class folders in loader workers: exit 75
    within the grace period, and the same container command resumes to the host's uninterrupted weights."""
    from tests.engines.test_docker_job import IMAGE, docker, shared_folder

    expected = reference("class folders", folders, shards, tmp_path_factory)
    shared = shared_folder(tmp_path / "shared")
    data = tmp_path / "data"
    shutil.copytree(folders, data)
    data.chmod(0o755)
    command = [
        "python", "-m", "launch.local", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml",
        "run_dir=/shared/run", "data.image_size=32", "train.batch_size=32", f"train.epochs={EPOCHS}",
        "checkpoint.every_steps=1000", "data.name=imagefolder", "data.root=/data", "data.loader=pil",
        "data.num_workers=2",
    ]  # fmt: skip
    name = f"tl-stop-{tmp_path.name[-12:].lower()}".replace("_", "-")
    run = ["run", "--name", name, "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--shm-size", "256m"]
    run += ["-e", "OMP_NUM_THREADS=1", "-v", f"{shared}:/shared", "-v", f"{data}:/data:ro"]
    docker(*run, "-d", IMAGE, *command)
    try:
        beat = shared / "run" / "progress" / "rank-0.json"
        deadline = time.monotonic() + 300
        while not (beat.exists() and '"step": ' in beat.read_text(errors="replace")):
            if time.monotonic() >= deadline:
                stderr = docker("logs", name, check=False).stderr[-3000:]
                pytest.fail(f"no step within 300 s\n{stderr}\n{rank_stacks(docker, name, beat.parent)}")
            time.sleep(0.1)  # polling the shared volume, bounded by the deadline
        grace = 30
        start = time.monotonic()
        docker("stop", "-t", str(grace), name, timeout=grace + 30)
        took = time.monotonic() - start
        code = int(docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip())
        logs = docker("logs", name, check=False)
        assert code == PREEMPTED, logs.stderr[-3000:]
        assert took < grace, took  # ended by its own checkpoint and exit, not by the SIGKILL
        assert "DataLoader worker" not in logs.stderr and "preempted with a committed checkpoint" in logs.stderr
        print(f"docker stop -t {grace}: exit 75 after {took:.1f} s")
    finally:
        docker("rm", "-f", name, check=False)
    docker(*run, "--rm", IMAGE, *command, timeout=600)
    assert_models_equal(shared / "run" / "model.pt", expected)
