"""launch.slurm with recovery.live=true, without a cluster: the sbatch it renders (golden), each decision
of backends.slurm.live (who runs live, the task's env, the job's code from the tasks' records), and the
batch script's `srun` wrapper (tests/integration/test_slurm_live_batch.py runs it in bash). The real
cluster: tests/engines/test_live_slurm.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.test_user_programs import check_golden
from torchlaunch import contract, rundir
from torchlaunch.backends.slurm import launch as slurm_launch
from torchlaunch.backends.slurm import live as slurm_live
from torchlaunch.backends.slurm.render import SlurmOptions, executor_parameters, sbatch_script
from torchlaunch.backends.slurm.result import result_path
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED, BadInput
from torchlaunch.launch.spec import JobSpec

SERVICE = "http://10.0.0.9:29510"
LIVE = SlurmOptions(python="/opt/venv/bin/python", repo_root="/opt/repo", lighthouse=SERVICE)


def spec(**changes: object) -> JobSpec:
    base = JobSpec(config="configs/cifar10.yaml", nodes=2, gpus_per_node=8, run_dir="/shared/runs/live", time_min=240)
    return dataclasses.replace(base, **changes)


def test_live_sbatch_matches_golden() -> None:
    check_golden("slurm_live.sbatch", sbatch_script(spec(), LIVE))


def test_live_node_range_sbatch_matches_golden() -> None:
    """--nodes 2-3 live: the elastic allocation (a node range, --mincpus, srun lays the tasks out) with
    live mode's --no-kill and verdict, which counts the tasks at run time."""
    check_golden("slurm_live_range.sbatch", sbatch_script(spec(nodes=3, min_nodes=2), LIVE))


def test_the_verdict_counts_the_allocations_tasks() -> None:
    assert slurm_live.task_count(8, "2") == 16
    assert slurm_live.task_count(1, "3") == 3
    assert slurm_live.task_count(1, "") == 0 and slurm_live.task_count(1, "x") == 0  # srun's code stands


def test_a_node_range_passes_its_minimum_to_every_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.slurm --nodes 2-3 recovery.live=true hands MIN to the submitted task (rendered, not run)."""
    monkeypatch.chdir(REPO)
    submitted: list = []
    monkeypatch.setattr(slurm_launch, "submit_task", lambda *args: submitted.append(args[-1]))
    ranged = spec(config="configs/smoke.yaml", nodes=3, min_nodes=2, gpus_per_node=1, run_dir=str(tmp_path))
    slurm_launch._submit(ranged, LIVE, str(tmp_path))
    assert submitted[0].live_minimum == {contract.LIVE_MIN_NODES: "2", contract.LIVE_NODE_RANGE: "--nodes 2-3"}
    slurm_launch._submit(spec(config="configs/smoke.yaml", run_dir=str(tmp_path)), LIVE, str(tmp_path))
    assert submitted[1].live_minimum == {}


def test_live_parameters_keep_the_job_and_step_alive_and_judge_srun() -> None:
    params = executor_parameters(spec(), LIVE, "/shared/runs/live")
    assert params["additional_parameters"]["no_kill"] is True
    assert params["srun_args"][:2] == ["--no-kill", "--kill-on-bad-exit=0"]
    assert any(line.startswith("srun() { srun_forwarding_stops") for line in params["setup"])
    plain = executor_parameters(spec(), dataclasses.replace(LIVE, lighthouse=""), "/shared/runs/live")
    assert "no_kill" not in plain["additional_parameters"] and "srun_args" not in plain


def decide(**changes: object) -> str:
    args: dict = dict(live=True, lighthouse=SERVICE, rejoin=0, nodes=2, ranks_per_node=1, image=False) | changes
    return slurm_live.lighthouse_of(args.pop("live"), args.pop("lighthouse"), args.pop("rejoin"), **args)


def test_who_runs_live() -> None:
    assert decide() == SERVICE
    assert decide(live=False) == ""
    assert decide(nodes=1, ranks_per_node=1) == ""  # one rank: nobody to regroup with
    assert decide(nodes=1, ranks_per_node=2) == SERVICE
    assert decide(lighthouse="") == slurm_live.PLACED  # no service named: the job's nodes place it
    assert decide(lighthouse="", nodes=1, ranks_per_node=1) == ""


def test_auto_runs_live_where_a_slurm_job_can_and_requeues_where_not() -> None:
    """recovery.live=auto, the default: live on several ranks; --image (not built live yet) takes the requeue
    road quietly, where an explicit true is refused (test_what_live_mode_refuses_in_one_line)."""
    assert decide(live="auto", lighthouse="") == slurm_live.PLACED
    assert decide(live="auto", nodes=1, ranks_per_node=1) == ""
    assert decide(live="auto", image=True) == ""
    assert slurm_live.IMAGE_WHY in slurm_live.road_line(False, slurm_live.IMAGE_WHY)
    assert "(recovery.live=false)" in slurm_live.road_line(False)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"rejoin": 2}, "recovery.rejoin=2 needs the local live agent"),
        ({"image": True}, "with --image is not built yet"),
    ],
)
def test_what_live_mode_refuses_in_one_line(changes: dict, words: str) -> None:
    with pytest.raises(BadInput, match=words) as caught:
        decide(**changes)
    assert "\n" not in str(caught.value)


def test_task_env_names_the_service_and_the_store_host() -> None:
    assert slurm_live.task_env(SERVICE, "10.0.0.3") == {
        contract.LIGHTHOUSE: SERVICE,
        contract.LIVE_STORE_HOST: "10.0.0.3",
    }
    least = slurm_live.minimum_env(2, 3)
    assert slurm_live.task_env(SERVICE, "10.0.0.3", least) == {
        contract.LIGHTHOUSE: SERVICE,
        contract.LIVE_STORE_HOST: "10.0.0.3",
        contract.LIVE_MIN_NODES: "2",
        contract.LIVE_NODE_RANGE: "--nodes 2-3",
    }
    assert slurm_live.task_env(SERVICE, "10.0.0.3", placed=True) == {
        contract.LIGHTHOUSE: SERVICE,
        contract.LIVE_STORE_HOST: "10.0.0.3",
        contract.LIVE_PLACED: "1",  # the service may move: the rank follows the run dir's lease
    }
    assert slurm_live.minimum_env(None, 2) == {}  # a fixed --nodes N trains on down to one rank
    assert slurm_live.node_store_host(SERVICE, 1, "n1") == "127.0.0.1"  # one node: loopback


@pytest.mark.parametrize(
    ("srun", "codes", "expected"),
    [
        (137, [OK, None], OK),  # node 2 lost, the survivor finished: the job finished
        (137, [None, OK], OK),
        (137, [FAILURE, None], FAILURE),
        (137, [PREEMPTED, None], PREEMPTED),
        (2, [BAD_INPUT, BAD_INPUT], BAD_INPUT),
        (137, [None, None], 137),  # nothing recorded: srun's word stands
        (1, [OK, FAILURE], FAILURE),
    ],
)
def test_the_jobs_code_is_the_survivors(srun: int, codes: list, expected: int) -> None:
    assert slurm_live.job_code(srun, codes) == expected


def write_record(run_dir: Path, job: str, task: int, code: int, launch: str) -> None:
    folder = rundir.slurm(run_dir) / job
    folder.mkdir(parents=True, exist_ok=True)
    rundir.write_json(result_path(folder, job, task), {"code": code, "why": "", "launch": launch})


def test_a_record_of_an_earlier_allocation_does_not_count(tmp_path: Path) -> None:
    write_record(tmp_path, "7", 0, OK, "7-1")
    write_record(tmp_path, "7", 1, PREEMPTED, "7-0")  # before the requeue
    assert slurm_live.recorded_codes(rundir.slurm(tmp_path) / "7", "7", "7-1", 2) == [OK, None]


def test_a_task_left_out_of_the_group_that_trained_counts_as_lost_not_as_bad_input(tmp_path: Path) -> None:
    """A node frozen past the bound and woken after the others regrouped: its rank is fenced (exit 2, never
    retried), and the run finished on the others: the job finished (tests/engines/test_live_slurm.py's
    [woken] case delivers it from outside)."""
    folder = rundir.slurm(tmp_path) / "7"
    write_record(tmp_path, "7", 0, OK, "7-0")
    rundir.write_json(result_path(folder, "7", 1), {"code": BAD_INPUT, "why": "", "launch": "7-0", "left_out": True})
    codes = slurm_live.recorded_codes(folder, "7", "7-0", 2)
    assert codes == [OK, None] and slurm_live.job_code(1, codes) == OK
    write_record(tmp_path, "7", 1, BAD_INPUT, "7-0")  # a bad input of its own is still the job's
    assert slurm_live.job_code(1, slurm_live.recorded_codes(folder, "7", "7-0", 2)) == BAD_INPUT


def test_a_fenced_group_marks_its_process_left_out() -> None:
    from torchlaunch.live import fence

    before = fence._left_out
    try:
        fence._left_out = False
        assert not fence.left_out()
        with pytest.raises(fence.Fenced):
            raise fence.Fenced("live error: superseded")
        assert fence.left_out()
    finally:
        fence._left_out = before


def test_launch_slurm_places_the_service_without_one_named_and_says_its_road(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """recovery.live=true with no recovery.lighthouse: nothing to start by hand, the job runs live (its
    sbatch keeps the job and step alive and judges srun) and the launch says so in one line."""
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    argv = ["--nodes", "2", "--gpus-per-node", "1", "--dry-run", "--config", "configs/smoke.yaml"]
    assert slurm_launch.main([*argv, f"run_dir={run_dir}", "recovery.live=true"]) == OK
    out, err = capsys.readouterr()
    assert "#SBATCH --no-kill" in out and "srun_forwarding_stops" in out, out
    assert err.strip().splitlines() == [slurm_live.road_line(True)], err
    assert not run_dir.exists()
    assert slurm_launch.main([*argv, f"run_dir={run_dir}", "recovery.live=false"]) == OK
    out, err = capsys.readouterr()
    assert "--no-kill" not in out and err.strip().splitlines() == [slurm_live.road_line(False)], err


def test_one_task_requeues_a_group_stopped_below_the_minimum() -> None:
    """The launch's rank 0 requeues a preemption; after a stop below --nodes MIN-MAX's minimum the live
    group's rank 0 does, which is another task when the launch's rank 0 was the process lost."""
    from torchlaunch.backends.slurm.task import requeues

    assert requeues(0, False) and requeues(0, True)
    assert not requeues(1, False)
    assert requeues(1, True)
