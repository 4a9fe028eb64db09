"""launch.local: the pure torchrun argv (golden files), thread budget, exit-code mapping, the CLI's checks."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch.agent import commands, node, options, outcome, ranks, stops
from torchlaunch.agent.commands import NodePlacement, torchrun_argv
from torchlaunch.agent.outcome import combine_exit_codes
from torchlaunch.agent.ranks import worker_threads
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED, BadInput
from torchlaunch.jobs import lost
from torchlaunch.launch.spec import JobSpec

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SMOKE = str(REPO / "configs" / "smoke.yaml")


def check_golden(name: str, argv: list[str]) -> None:
    """One argument per line; UPDATE_GOLDEN=1 rewrites the file (review the diff before committing)."""
    path = GOLDEN / name
    text = "\n".join(argv) + "\n"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"torchrun argv changed; if intended, UPDATE_GOLDEN=1 and review {path}"


def test_single_node_argv_golden() -> None:
    spec = JobSpec(config="runs/golden/config.yaml", gpus_per_node=4, max_restarts=2)
    check_golden("local_argv_single.txt", torchrun_argv(spec, NodePlacement(), python="python"))


def test_multi_node_argv_golden() -> None:
    spec = JobSpec(config="runs/golden/config.yaml", nodes=2, gpus_per_node=8, master_port=29555)
    argv = torchrun_argv(
        spec, NodePlacement(node_rank=1, master_addr="node0"), python="python", rdzv_run_id="tl-golden"
    )
    check_golden("local_argv_multi.txt", argv)


def test_node_zero_hosts_the_rendezvous() -> None:
    spec = JobSpec(config="c.yaml", nodes=2)
    argv = torchrun_argv(spec, NodePlacement(0, "node0"), rdzv_run_id="x")
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=true"
    assert "--standalone" not in argv


def test_multi_node_needs_master_addr() -> None:
    with pytest.raises(BadInput, match="--master-addr is required"):
        torchrun_argv(JobSpec(config="c.yaml", nodes=2), NodePlacement(1, None))


def test_run_id_is_stable_per_run_dir() -> None:
    assert commands.run_id("runs/a") == commands.run_id(os.path.abspath("runs/a"))
    assert commands.run_id("runs/a") != commands.run_id("runs/b")
    assert commands.run_id("runs/a").startswith("tl-")


@pytest.mark.parametrize(
    ("procs", "cores", "threads"),
    [
        (1, 2, 2),
        (2, 2, 1),
        (4, 2, 1),
        (3, 16, 5),
        (8, 64, 8),
        (0, 4, 4),
    ],
)
def test_worker_threads_never_oversubscribe(procs: int, cores: int, threads: int) -> None:
    assert worker_threads(procs, cores) == threads
    assert threads >= 1 and (procs * threads <= cores or threads == 1)


@pytest.mark.parametrize(
    ("torchrun", "workers", "expected"),
    [
        (0, [], OK),
        (0, [OK, OK], OK),
        (1, [BAD_INPUT, BAD_INPUT], BAD_INPUT),
        (1, [BAD_INPUT, FAILURE], BAD_INPUT),  # bad input wins: retrying cannot help
        (1, [PREEMPTED, PREEMPTED], PREEMPTED),
        (1, [PREEMPTED, OK], PREEMPTED),
        (1, [PREEMPTED, FAILURE], FAILURE),  # a crash during preemption is not a clean checkpoint
        (1, [], FAILURE),  # torchrun failed before any worker reported
        (1, [OK, OK], FAILURE),
        (-15, [PREEMPTED], PREEMPTED),
    ],
)
def test_combine_exit_codes(torchrun: int, workers: list[int], expected: int) -> None:
    assert combine_exit_codes(torchrun, workers) == expected


def test_launch_env() -> None:
    spec = JobSpec(config="c.yaml", gpus_per_node=2)
    env = ranks.launch_env(spec, {"PATH": "/bin"}, cores=8, attempt="abc")
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env[ranks.ATTEMPT_ENV] == "abc" and env["PATH"] == "/bin"
    assert ranks.launch_env(spec, {"OMP_NUM_THREADS": "3"}, 8, "a")["OMP_NUM_THREADS"] == "3"  # user's wins


def test_attempt_env_matches_the_runner() -> None:
    from torchlaunch import status

    assert ranks.ATTEMPT_ENV == status.ATTEMPT_ENV  # what the runner reads to report each rank


def test_read_worker_codes_takes_only_this_attempt(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.mkdir()
    (status / "a1-rank0.json").write_text(json.dumps({"code": 2, "reason": "data error: x", "rank": 0}))
    (status / "a1-rank1.json").write_text(json.dumps({"code": 0, "reason": "finished", "rank": 1}))
    (status / "a1-rank2.json").write_text("{not json")
    (status / "other-rank0.json").write_text(json.dumps({"code": 75}))
    codes, reasons = outcome.read_worker_codes(tmp_path, "a1")
    assert codes == [2, 0] and reasons == ["data error: x", "finished"]
    assert sorted(p.name for p in status.iterdir()) == ["other-rank0.json"]  # consumed, others untouched


@pytest.mark.parametrize(("extra", "direct"), [([], True), (["--max-restarts", "1"], False), (["--doctor"], False)])
def test_one_worker_without_restarts_skips_the_agent(
    extra: list[str], direct: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = node.main(
        ["--gpus", "1", *extra, "--device", "cpu", "--config", SMOKE, "--dry-run", f"run_dir={tmp_path}", "seed=3"]
    )
    argv = shlex.split(capsys.readouterr().out)
    assert rc == 0
    if direct:
        assert argv == [
            sys.executable,
            *("-m", "torchlaunch.runner", "-m", "torchlaunch.worker"),
            *("--config", SMOKE, f"run_dir={tmp_path}", "seed=3"),
        ]
    else:
        assert argv[1:3] == ["-m", "torchlaunch.launch.torchrun"] and "--nproc-per-node" in argv


@pytest.mark.parametrize(("visible", "gpus", "code"), [(1, 2, BAD_INPUT), (4, 8, BAD_INPUT), (2, 2, OK)])
def test_more_gpus_than_visible(
    visible: int,
    gpus: int,
    code: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No GPU exists on the CI machines, so the visible-GPU count is faked in-process; everything
    # else (argument parsing, config loading, the check itself) is the real launcher code.
    monkeypatch.setattr(options, "visible_gpus", lambda: visible)
    rc = node.main(["--gpus", str(gpus), "--config", SMOKE, "--dry-run", f"run_dir={tmp_path}"])
    captured = capsys.readouterr()
    assert rc == code
    if code == BAD_INPUT:
        assert captured.err.splitlines() == [
            f"launch error: GPUS={gpus} but only {visible} GPU(s) are visible "
            f"(use GPUS<={visible} or check CUDA_VISIBLE_DEVICES)"
        ]
        assert captured.out == ""
    else:  # live by default on two ranks: the live agent's command
        assert "torchlaunch.agent.live --nproc 2" in captured.out, captured.out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 outside 0..1"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--nnodes", "2"], "--master-addr is required"),
        (["--master-wait-s", "-1"], "--master-wait-s must be >= 0"),
        (
            ["--master-wait-s", str(options.MASTER_WAIT_MAX_S + 1)],
            f"--master-wait-s must be at most {options.MASTER_WAIT_MAX_S}",
        ),
    ],
)
def test_bad_launcher_arguments(
    args: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = node.main([*args, "--device", "cpu", "--config", SMOKE, "--dry-run", f"run_dir={tmp_path}"])
    err = capsys.readouterr().err.splitlines()
    assert rc == BAD_INPUT and len(err) == 1 and words in err[0], err


class FlakyDns:
    """socket.getaddrinfo for a name whose record appears after `misses` look-ups (a pod not started yet)."""

    def __init__(self, misses: int) -> None:
        self.misses, self.calls = misses, 0

    def __call__(self, host: str, *rest: object) -> list:
        self.calls += 1
        if self.calls <= self.misses:
            raise ranks.socket.gaierror(-2, "Name or service not known")
        return [(2, 1, 6, "", ("10.0.0.7", 0))]


def test_master_wait_asks_again_until_the_name_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    dns = FlakyDns(misses=3)
    monkeypatch.setattr(options.shape.socket, "getaddrinfo", dns)
    monkeypatch.setattr(options, "MASTER_POLL_S", 0.01)
    options.resolve_master_addr("lv-0.lv", 60)  # returns once the record is there
    assert dns.calls == 4


def test_master_wait_zero_refuses_at_once_as_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    dns = FlakyDns(misses=3)
    monkeypatch.setattr(options.shape.socket, "getaddrinfo", dns)
    with pytest.raises(BadInput, match="--master-addr 'lv-0.lv' does not resolve"):
        options.resolve_master_addr("lv-0.lv", 0)
    assert dns.calls == 1


def test_master_wait_that_runs_out_is_exit_1_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the wait it is node 0 or DNS that is missing, not the input: retryable (exit 1)."""
    dns = FlakyDns(misses=10**6)
    monkeypatch.setattr(options.shape.socket, "getaddrinfo", dns)
    monkeypatch.setattr(options, "MASTER_POLL_S", 0.01)
    clock = iter(range(0, 10**6))  # each monotonic() read is one second later
    monkeypatch.setattr(options.time, "monotonic", lambda: float(next(clock)))
    with pytest.raises(outcome.LaunchEnded) as ended:
        options.resolve_master_addr("lv-0.lv", 5)
    assert ended.value.code == FAILURE and "\n" not in ended.value.line
    assert "--master-addr 'lv-0.lv' still does not resolve after --master-wait-s 5" in ended.value.line
    assert 1 < dns.calls <= 6


def test_a_stop_while_waiting_for_node_0s_name_is_exit_75(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options.shape.socket, "getaddrinfo", FlakyDns(misses=10**6))
    monkeypatch.setattr(stops, "EARLY_SIGNALS", [stops.signal.SIGTERM])
    with pytest.raises(outcome.LaunchEnded) as ended:
        options.resolve_master_addr("lv-0.lv", 600)
    assert ended.value.code == PREEMPTED and "SIGTERM while waiting for --master-addr 'lv-0.lv'" in ended.value.line


def test_the_ranks_window_comes_from_the_platforms_grace() -> None:
    """Issue #53: torchrun's SIGTERM -> SIGKILL window is the grace less the launcher's margin, not a
    fixed 30 s (docker stop kills at 10 s); the pod's grace comes through TORCHLAUNCH_GRACE_S; where none
    is stated (or it is not a number of seconds), the platform's default: 10 s in a container, 30 s in a
    pod, torch's 30 s where no platform is seen."""
    window = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    assert stops.stop_env({}, container=True) == {"TORCHLAUNCH_GRACE_S": "10", window: "8"}
    assert stops.stop_env({}, container=False) == {"TORCHLAUNCH_GRACE_S": "30", window: "28"}
    assert stops.stop_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, container=True)[window] == "28"
    assert stops.stop_env({"TORCHLAUNCH_GRACE_S": "120"}, container=True)[window] == "118"
    assert stops.stop_env({"TORCHLAUNCH_GRACE_S": "2.5"}, container=True)[window] == "1"
    for junk in ("nan", "-5", "0", "1e400", "ten"):
        assert stops.stop_env({"TORCHLAUNCH_GRACE_S": junk}, container=True)[window] == "8", junk


def test_a_stop_that_lost_steps_counts_them_from_this_launchs_heartbeats(tmp_path: Path) -> None:
    """Issue #53 (honest codes): the steps this launch's ranks trained past the newest checkpoint; a beat
    of an earlier launch (which trained further, then lost it) is not this launch's loss."""
    beats = tmp_path / "progress"
    beats.mkdir()
    for rank, (launch_id, step) in enumerate([("this", 7), ("this", 6), ("earlier", 40)]):
        (beats / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "launch": launch_id, "step": step}))
    assert lost.steps_lost(tmp_path, "this") == (7, None)
    assert lost.steps_lost(tmp_path, "another") == (0, None)
    assert "at least 7 step(s) trained since the beginning (no checkpoint) are lost (exit 1)" in lost.lost_line(
        (7, None), []
    )
    # CI at ccda0fd: the stop's window ran out, rank 0 was killed first and rank 1 failed on its closed
    # connection (exit 1, a worker's RuntimeError): still the stop's loss, said as such, not "training failed".
    assert lost.lost_by_stop(FAILURE, True, tmp_path, "this", None) == (7, None)
    assert lost.lost_by_stop(PREEMPTED, True, tmp_path, "this", None) == (7, None)
    assert lost.lost_by_stop(FAILURE, False, tmp_path, "this", None) == (0, None)  # no stop: a failure's own
    assert lost.lost_by_stop(BAD_INPUT, True, tmp_path, "this", None) == (0, None)


def test_a_stop_other_than_sigterm_is_named_when_passed_on_as_sigterm(capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 51 item 10: Ctrl-C reached the ranks as SIGTERM ("received SIGTERM") and nothing said so. The
    relay keeps SIGTERM (the stop every program handles, a user's script included) and names what came."""
    import signal

    from torchlaunch.agent.stops import StopRelay

    class Child:
        pid = 0

        def __init__(self) -> None:
            self.sent: list[int] = []

        def send_signal(self, sig: int) -> None:
            self.sent.append(sig)

    child = Child()
    relay = StopRelay([], [child])  # type: ignore[list-item]
    relay.receive(signal.SIGINT, None)
    relay.receive(signal.SIGTERM, None)  # the same stop: not passed on again, not said again
    assert child.sent == [signal.SIGTERM]
    lines = capfd.readouterr().err.splitlines()
    assert lines == [
        "launch: SIGINT: passed on to the ranks as SIGTERM, the stop every program handles (they checkpoint at one "
        "agreed step); Ctrl-C again stops at once, without a checkpoint"
    ]
    quiet = StopRelay([], [Child()])  # type: ignore[list-item]
    quiet.receive(signal.SIGTERM, None)
    assert capfd.readouterr().err == ""
