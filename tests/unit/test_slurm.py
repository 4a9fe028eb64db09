"""launch.slurm without a cluster: the pure JobSpec -> sbatch mapping, argument errors, timeout rule."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv
from torchlaunch.backends.slurm import cluster as slurm_cluster
from torchlaunch.backends.slurm.render import (
    SlurmOptions,
    executor_parameters,
    resolve_run_dir,
    sbatch_script,
    worker_argv,
)
from torchlaunch.backends.slurm.task import is_timeout
from torchlaunch.exit_codes import CANCELLED, BadInput
from torchlaunch.launch.spec import JobSpec

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
FIXED = SlurmOptions(python="/opt/venv/bin/python", repo_root="/opt/repo")


def full_spec() -> JobSpec:
    return JobSpec(
        config="configs/cifar10.yaml",
        overrides=("optim.lr=0.2",),
        nodes=2,
        gpus_per_node=8,
        run_dir="/shared/runs/a",
        time_min=240,
        partition="gpu",
        account="vision",
        qos="high",
        constraint="h100",
        cpus_per_task=12,
        mem_gb=480,
        signal_delay_s=120,
        extra={"mail-type": "END"},
    )


def test_sbatch_script_matches_golden() -> None:
    assert sbatch_script(full_spec(), FIXED) == (GOLDEN / "slurm_gpu.sbatch").read_text()


def test_sbatch_script_cpu_workers_with_pyxis_matches_golden() -> None:
    spec = JobSpec(
        config="configs/smoke.yaml",
        nodes=2,
        gpus_per_node=2,
        run_dir="/shared/runs/b",
        time_min=30,
        image="nvcr.io/nvidia/pytorch:25.01-py3",
    )
    options = SlurmOptions(use_gpus=False, repo_root="/opt/repo")
    assert sbatch_script(spec, options) == (GOLDEN / "slurm_cpu_pyxis.sbatch").read_text()


def test_one_task_per_gpu_and_requeue_flag() -> None:
    params = executor_parameters(full_spec(), FIXED, "/shared/runs/a")
    assert params["nodes"] == 2 and params["ntasks_per_node"] == 8 and params["gpus_per_node"] == 8
    assert params["additional_parameters"]["requeue"] is True
    cpu = executor_parameters(full_spec(), SlurmOptions(use_gpus=False), "/shared/runs/a")
    assert "gpus_per_node" not in cpu and cpu["ntasks_per_node"] == 8


def test_worker_argv_pins_the_run_dir_and_keeps_overrides(tmp_path: Path) -> None:
    spec = JobSpec(config="configs/smoke.yaml", overrides=("train.epochs=2", f"run_dir={tmp_path}/x"))
    run_dir = resolve_run_dir(spec)
    assert run_dir == f"{tmp_path}/x"
    argv = worker_argv(spec, run_dir)
    assert argv == [
        "--config",
        os.path.abspath("configs/smoke.yaml"),
        "train.epochs=2",
        "preemption.lead_time_s=90",
        f"run_dir={tmp_path}/x",
    ]


def test_run_dir_defaults_to_the_yaml_one_made_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert resolve_run_dir(JobSpec(config="configs/smoke.yaml")) == str(REPO / "runs/smoke")


def test_missing_config_is_bad_input() -> None:
    with pytest.raises(BadInput, match="file not found"):
        resolve_run_dir(JobSpec(config="/nonexistent.yaml"))


@pytest.mark.parametrize(
    ("elapsed_s", "time_min", "delay_s", "expected"),
    [
        (600, 240, 90, False),  # preempted early: keeps the timeout budget
        (240 * 60 - 90, 240, 90, True),  # the time-limit signal
        (240 * 60 - 90 - 60, 240, 90, True),  # Slurm may signal up to 60 s early
        (30 * 60 - 300, 30, 90, False),  # submitit's min(0.8 T, T - 10 min) would call this a timeout
        (20, 1, 30, True),  # T = 1 min: the signal can only be the time limit
    ],
)
def test_timeout_rule(elapsed_s: float, time_min: int, delay_s: int, expected: bool) -> None:
    assert is_timeout(elapsed_s, time_min, delay_s) is expected


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        launcher_argv("torchlaunch.backends.slurm.launch", *args),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


class FinishedJob:
    """Just what exit_status reads from a submitit job: its id and its folder."""

    job_id = "42"

    def __init__(self, folder: Path) -> None:
        self.paths = type("Paths", (), {"folder": folder})()


@pytest.mark.parametrize(
    ("state", "result", "code"),
    [
        ("COMPLETED", None, 0),
        ("CANCELLED by 0", None, CANCELLED),
        ("FAILED", (2, "bad input, not requeued"), 2),
        ("FAILED", (75, "timed out 4 times (limit 3)"), 75),
        ("FAILED", (CANCELLED, "job 42 was cancelled (python -m launch cancel), not requeued"), CANCELLED),
        ("FAILED", (1, "worker failed"), 1),
        ("FAILED", None, 1),
        ("TIMEOUT", None, 1),
    ],
)
def test_exit_status_maps_slurm_states_to_project_codes(
    state: str, result: tuple[int, str] | None, code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The code travels as data: task 0's result record, never its exception's text."""
    from torchlaunch import rundir
    from torchlaunch.backends.slurm.follow import exit_status
    from torchlaunch.backends.slurm.result import result_path

    if result is not None:
        rundir.write_json(result_path(tmp_path, "42"), {"code": result[0], "why": result[1]})
    assert exit_status(FinishedJob(tmp_path), state) == code
    if code:
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        if result is not None and code != 1:
            assert err[0] == f"worker exit code {code}: {result[1]}"


def test_worker_argv_passes_the_signal_lead_time_unless_set() -> None:
    argv = worker_argv(full_spec(), "/shared/runs/a")
    assert "preemption.lead_time_s=120" in argv and argv[-1] == "run_dir=/shared/runs/a"
    own = full_spec().replace(overrides=("preemption.lead_time_s=300",))
    assert [a for a in worker_argv(own, "/r") if a.startswith("preemption.lead_time_s")] == [
        "preemption.lead_time_s=300"
    ]


def test_a_shorter_partition_grace_time_is_the_workers_lead_time() -> None:
    """Issue #53: a preemption leaves the partition's GraceTime, not the --signal lead time; the worker
    warns against the shorter one. GraceTime comes from `scontrol show partition NAME -o`."""
    line = "PartitionName=low AllowGroups=ALL Default=YES GraceTime=30 Hidden=NO MaxNodes=UNLIMITED State=UP"
    assert slurm_cluster.grace_time_of(line) == 30
    assert slurm_cluster.grace_time_of(line.replace("GraceTime=30", "GraceTime=0")) is None  # none stated
    assert slurm_cluster.grace_time_of("PartitionName=x DefaultTime=NONE") is None
    assert "preemption.lead_time_s=30" in worker_argv(full_spec(), "/r", grace_time_s=30)
    assert "preemption.lead_time_s=120" in worker_argv(full_spec(), "/r", grace_time_s=600)  # the signal's is shorter


def test_the_master_port_is_shared_by_the_tasks_below_the_ephemeral_range_and_moves_on_requeue() -> None:
    """Every task computes rank 0's port alone, so it is a function of what they all see (job id and
    requeue count); it stays below Linux's ephemeral ports (an outgoing connection's local end took
    submitit's port once: EADDRINUSE on rank 0, the others waiting 300 s), and a requeue moves it."""
    from torchlaunch.backends.slurm.task import MASTER_PORTS, master_port

    low, high = MASTER_PORTS
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert high < ephemeral_low or ephemeral_low > 32767  # this box's range starts at 32768 or higher
    ports = {master_port(f"{job}-0") for job in range(1, 2001)}
    assert all(low <= p <= high for p in ports) and len(ports) > 1800  # spread like random draws (~1851 expected)
    assert master_port("4242-0") == master_port("4242-0")  # the same on every task of the allocation
    assert sum(master_port(f"{job}-0") != master_port(f"{job}-1") for job in range(1, 201)) >= 199


def test_the_tasks_pythonpath_and_the_container_mount_are_the_checkouts() -> None:
    """The batch script's PYTHONPATH folder holds the torchlaunch link (rankpath), and the pyxis mount
    and workdir are the checkout, not the package folder inside it (tasks had imported torchlaunch only
    through the editable install)."""
    from torchlaunch import rankpath
    from torchlaunch.backends.slurm.render import SlurmOptions

    root = Path(SlurmOptions().repo_root)
    assert (root / rankpath.FOLDER.name / "torchlaunch").is_dir()
    assert (root / "torchlaunch" / "__init__.py").is_file()
