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


def _killed_allocation(run: Path, launch: str, job: str, trained: int, checkpoint: int | None) -> None:
    """A run dir as a Slurm allocation SIGKILLed mid-save leaves it: node 0's record without an outcome,
    its ranks' heartbeats flushed at the stop, and the newest checkpoint that did commit."""
    import json

    from torchlaunch.jobs import progress, record

    record.start(run, scheduler="slurm", command=["launch.slurm"], launch_id=launch, job_id=job)
    beats = progress.folder(run)
    beats.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        (beats / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "launch": launch, "step": trained}))
    if checkpoint is not None:
        import torch

        from torchlaunch.core import checkpoint as ckpt

        state = {"format_version": ckpt.FORMAT_VERSION, "w": torch.zeros(2)}
        ckpt.write_checkpoint(run / "checkpoints", checkpoint, state, {})


def test_the_allocation_after_a_killed_one_says_the_steps_lost_and_records_exit_1(tmp_path: Path) -> None:
    """Issue #53 (honest codes): Slurm SIGKILLs tasks still saving when GraceTime runs out and requeues;
    the next allocation's node 0 says how many steps were lost since which checkpoint, and records that
    allocation's outcome as a stop that lost work (exit 1), once."""
    from torchlaunch.backends.slurm.killed import killed_before
    from torchlaunch.jobs import record

    _killed_allocation(tmp_path, "77-0", "77", trained=9, checkpoint=4)
    line = killed_before(tmp_path, "77", "77-1")
    assert line.startswith("allocation 77-0 of job 77 ended without a word"), line
    assert "at least 5 step(s) trained since the checkpoint of step 4 are lost (exit 1)" in line, line
    (node0,), _ = record.read_all(tmp_path)
    assert (node0.launch_id, node0.outcome, node0.code, node0.reason) == ("77-0", "failed", 1, line)
    assert killed_before(tmp_path, "77", "77-1") == ""  # said once: the allocation has its outcome now


@pytest.mark.parametrize(
    ("job", "launch", "trained"),
    [("78", "77-1", 9), ("77", "77-0", 9), ("77", "77-1", 4), ("77", "77-1", 0)],
    ids=["another job", "this allocation", "nothing past the checkpoint", "nothing trained"],
)
def test_an_allocation_that_lost_nothing_or_is_not_the_one_before_is_not_reported(
    tmp_path: Path, job: str, launch: str, trained: int
) -> None:
    from torchlaunch.backends.slurm.killed import killed_before
    from torchlaunch.jobs import record

    _killed_allocation(tmp_path, "77-0", "77", trained=trained, checkpoint=4)
    assert killed_before(tmp_path, job, launch) == ""
    (node0,), _ = record.read_all(tmp_path)
    assert node0.outcome is None


def test_a_slurm_task_whose_stop_did_not_commit_says_the_steps_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #53: a built-in trainer's exit 75 on Slurm, where its ranks trained past the checkpoint rank
    0 said it committed (or past the newest one), is rank 0's lost line (the task then exits 1), as
    launch.local says it; a user's program, another rank, or a stop that committed its step is not."""
    from torchlaunch import status
    from torchlaunch.backends.slurm.task import SlurmTask
    from torchlaunch.exit_codes import PREEMPTED

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setattr(status, "_committed", None)
    _killed_allocation(tmp_path, "77-0", "77", trained=9, checkpoint=None)
    builtin = SlurmTask(argv=["-m", "torchlaunch.worker", "--config", "c.yaml"], time_min=60, signal_delay_s=90)
    builtin.run_dir = str(tmp_path)
    line = builtin._lost(0, PREEMPTED)
    assert "at least 9 step(s) trained since the beginning (no checkpoint) are lost (exit 1)" in line, line
    status.note_committed(6)
    assert "at least 3 step(s) trained since the checkpoint of step 6" in builtin._lost(0, PREEMPTED)
    assert builtin._lost(1, PREEMPTED) == "" and builtin._lost(0, 1) == ""
    status.note_committed(9)
    assert builtin._lost(0, PREEMPTED) == ""
    status.note_committed(6)
    user = SlurmTask(argv=["train.py"], time_min=60, signal_delay_s=90, run_dir=str(tmp_path))
    assert user._lost(0, PREEMPTED) == ""


def test_a_stop_that_lost_steps_is_requeued_and_its_task_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #53: rank 0 of a stop that lost steps requeues the job as any stop (the next allocation
    resumes from the checkpoint), says no checkpoint was committed, and its task exits 1; where the
    job is ending (COMPLETING), the task's recorded code is 1 with the lost line, not 75."""
    from torchlaunch.backends.slurm import task as task_mod
    from torchlaunch.exit_codes import FAILURE

    class Left(Exception):
        pass

    class Accepted:
        code, err = 0, ""

    def leave(code: int) -> None:
        raise Left(code)

    requeued: list[str] = []
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(task_mod, "leave", leave)
    monkeypatch.setattr(task_mod, "controller_state", lambda job: "RUNNING")
    monkeypatch.setattr(task_mod.cluster, "requeue", lambda job: requeued.append(job) or Accepted())
    monkeypatch.setattr(task_mod.SlurmTask, "_save_for_requeue", lambda self: None)
    task = task_mod.SlurmTask(argv=["-m", "torchlaunch.worker"], time_min=60, signal_delay_s=90)
    with pytest.raises(Left) as left:
        task._requeue(0, 10.0, "stopped before its checkpoint committed: at least 3 step(s) ... are lost (exit 1)")
    assert left.value.args == (FAILURE,) and requeued == ["77"]
    assert "preemption: steps lost, job 77 requeued" in capsys.readouterr().out
    monkeypatch.setattr(task_mod, "controller_state", lambda job: "COMPLETING")
    monkeypatch.setattr(task_mod, "scancelled", lambda job, state: False)
    with pytest.raises(task_mod.WorkerExit) as ended:
        task._requeue(0, 10.0, "stopped ... are lost (exit 1)")
    assert ended.value.code == FAILURE and "COMPLETING, not requeued; stopped ... are lost (exit 1)" in ended.value.why
