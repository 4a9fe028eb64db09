"""A user's program in the Kubernetes Job, its pods run as real containers.

`python -m launch.k8s ... -- SCRIPT.py args` renders the Job (the real CLI, its YAML parsed back);
tests/engines/test_docker_job.py's harness turns each pod into a container and mimics the Job controller
(podFailurePolicy, backoffLimit). The image holds only the project (.dockerignore admits torchlaunch/,
launch/, train/, configs/), so the program's code goes on the shared volume and the pods run from it with
`--workdir /shared/code`, as docs/KUBERNETES.md documents for code that is not built into an image.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml

from tests.conftest import launcher_argv, run_cmd
from tests.engines.test_docker_job import (  # noqa: F401 - image is a fixture used by name
    DOCKER,
    JOB_TIMEOUT_S,
    ROOT,
    DockerJob,
    docker,
    image,
    open_job,
    shared_folder,
)
from tests.helpers import assert_models_equal
from tests.integration.test_namespace_fresh_interpreters import PROGRAMS as PROGRAMS_DIR
from tests.integration.test_namespace_fresh_interpreters import PROJECTS as USER_PROJECTS
from tests.integration.test_namespace_fresh_interpreters import assert_user_world
from torchlaunch.exit_codes import BAD_INPUT, OK, PREEMPTED

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CODE_DIR = "/shared/code"
"""Where the pods find the program: a folder on the shared volume (docs/KUBERNETES.md, option 2)."""
PROGRAMS = {
    "custom_loop.py": ROOT / "examples" / "custom_loop.py",
    "bad_input.py": ROOT / "tests" / "programs" / "bad_input.py",
    "devices_mismatch.py": ROOT / "tests" / "programs" / "devices_mismatch.py",
}
EPOCHS = 4
TOTAL = 32 * EPOCHS
"""2048 samples, global batch 64: 32 steps an epoch, 128 in all (a few seconds of training)."""
STOP_AT = 20
"""The step after which pod 1 is stopped: early, so the stop lands long before step TOTAL."""


def render_job(image_name: str, name: str, program: list[str], options: Sequence[str] = ()) -> dict:
    """The Job of `python -m launch.k8s ... -- PROGRAM` for 2 CPU pods, as the CLI prints it."""
    argv = launcher_argv(
        "torchlaunch.backends.k8s.launch",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--cpu-only",
        "--image",
        image_name,
        "--name",
        name,
        "--workdir",
        CODE_DIR,
        "--save-time-s",
        "20",
        "--step-time-s",
        "10",
        *options,
        "--",
        *program,
    )
    code, out, err = run_cmd(argv, timeout=60)
    assert code == OK, err
    job = next(m for m in yaml.safe_load_all(out) if m and m["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["workingDir"] == CODE_DIR
    return job


@pytest.fixture(scope="module")
def make_program_job(image, tmp_path_factory) -> Callable[..., DockerJob]:  # noqa: F811
    """Jobs of two CPU pods running a user's program from the shared volume; all removed at the end."""
    jobs: list[DockerJob] = []

    def make(name: str, *program: str, project: Path | None = None, options: Sequence[str] = ()) -> DockerJob:
        """`project`: a user's whole project folder as the code, instead of the single-file programs;
        `options`: more launch.k8s options."""
        job = render_job(image, name, list(program), options)
        folder = tmp_path_factory.mktemp(name)
        folder.chmod(0o755)
        shared = shared_folder(folder / "shared")
        code = shared / "code"
        if project is not None:
            shutil.copytree(project, code, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            code.mkdir()
            for target, source in PROGRAMS.items():
                shutil.copyfile(source, code / target)
        for path in [code, *code.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # read-only for the pods' user: the code is only read
        return open_job(job, folder, shared, jobs)

    yield make
    for dj in jobs:
        dj.cleanup()


def custom_loop(name: str) -> list[str]:
    return ["custom_loop.py", "--run-dir", f"/shared/runs/{name}", "--epochs", str(EPOCHS)]


@pytest.fixture(scope="module")
def host_reference(tmp_path_factory) -> Path:
    """The same script as 2 CPU ranks under launch.local on this machine: the weights to match."""
    run_dir = tmp_path_factory.mktemp("host") / "run"
    argv = launcher_argv(
        "torchlaunch.agent",
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--",
        "examples/custom_loop.py",
        "--run-dir",
        str(run_dir),
        "--epochs",
        str(EPOCHS),
    )
    code, out, err = run_cmd(argv, timeout=300)
    assert code == OK, err[-3000:]
    assert f"finished: {TOTAL} steps" in out
    return run_dir / "model.pt"


@pytest.fixture(scope="module")
def uninterrupted_program(make_program_job) -> DockerJob:
    dj = make_program_job("uref", *custom_loop("uref"))
    dj.run_until_complete(dj.start_all())
    return dj


def test_user_program_job_trains_end_to_end_bitwise_like_launch_local(uninterrupted_program, host_reference):
    dj = uninterrupted_program
    assert sorted(dj.history) == [(0, OK), (1, OK)], dj.history
    log = dj.logs(0)
    assert f"finished: {TOTAL} steps" in log and "resumed at step" not in log, log[-3000:]
    assert_models_equal(dj.run_dir / "model.pt", host_reference)


def follow_until(dj: DockerJob, index: int, prefix: str, timeout_s: float = 240) -> str:
    """Stream pod `index`'s log until a line starts with `prefix`; that line (the stream is bounded by a
    watchdog that ends it, and by the pod's own end)."""
    proc = subprocess.Popen(
        [DOCKER, "logs", "-f", dj.container(index)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(prefix):
                return line
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=30)
    raise AssertionError(f"pod {index}: no line {prefix!r} within {timeout_s}s:\n{''.join(seen)[-3000:]}")


def wait_exited(dj: DockerJob, index: int, timeout_s: float = 120) -> int:
    """Pod `index`'s exit code, once it has exited (bounded)."""
    result = docker("wait", dj.container(index), timeout=timeout_s)
    return int(result.stdout.strip())


def test_stopped_program_pod_exits_75_and_the_replacement_resumes_bitwise(make_program_job, uninterrupted_program):
    dj = make_program_job("ustop", *custom_loop("ustop"))
    running = dj.start_all()
    follow_until(dj, 0, f"step {STOP_AT}/{TOTAL} ")  # rank 0 (pod 0) prints every step
    start = time.monotonic()
    docker("stop", "-t", str(dj.grace_s), dj.container(1), timeout=dj.grace_s + 30)
    took = time.monotonic() - start
    assert dj.state(1) == ("exited", PREEMPTED), f"took {took:.1f}s:\n{dj.logs(1)[-3000:]}"
    assert took < dj.grace_s  # the program's own handler ran: not SIGKILLed at the end of the grace period
    assert "preempted with a committed checkpoint (exit 75)" in dj.logs(1)
    assert dj.action(PREEMPTED) == "Ignore"
    assert wait_exited(dj, 0) == PREEMPTED, dj.logs(0)[-3000:]  # every pod stops at the agreed step
    assert not (dj.run_dir / "model.pt").exists()

    dj.run_until_complete(running)

    assert dj.failures == 0, f"a preemption must not count against backoffLimit: {dj.history}"
    assert sorted(dj.history[:2]) == [(0, PREEMPTED), (1, PREEMPTED)], dj.history  # then replaced, once
    assert sorted(dj.history[2:]) == [(0, OK), (1, OK)], dj.history
    log = dj.logs(0)  # the replacement pod 0
    resumed = int(log.split("resumed at step ", 1)[1].split()[0])
    assert STOP_AT <= resumed < TOTAL, log[-3000:]
    print(f"pod 1 stopped after step {STOP_AT} in {took:.1f}s; the replacement resumed at step {resumed}")
    assert f"\nstep {resumed + 1}/{TOTAL} " in log and f"\nstep {resumed}/{TOTAL} " not in log  # none twice
    assert f"finished: {TOTAL} steps" in log
    assert_models_equal(dj.run_dir / "model.pt", uninterrupted_program.run_dir / "model.pt")


def test_bad_input_program_fails_the_job_without_retry(make_program_job):
    runs = "/shared/bad-input-runs.txt"  # one line per start of the program, on any rank
    dj = make_program_job("ubad", "bad_input.py", runs)
    running = dj.start_all()
    with pytest.raises(AssertionError, match="FailJob"):
        dj.run_until_complete(running, timeout_s=JOB_TIMEOUT_S)
    assert dj.history[0][1] == BAD_INPUT and dj.failures == 0, dj.history
    codes = [wait_exited(dj, i) for i in (0, 1)]
    assert codes == [BAD_INPUT, BAD_INPUT], codes
    assert "data error: --data /nonexistent.csv: no such file" in dj.logs(dj.history[0][0])
    starts = sorted((dj.shared / "bad-input-runs.txt").read_text().splitlines())
    assert starts == ["rank 0 restart 0", "rank 1 restart 0"], starts  # each rank started once, never again


def test_a_failed_pod_shows_its_ranks_error(make_program_job) -> None:
    dj = make_program_job("ufail", "devices_mismatch.py", options=("--backoff-limit", "0", "--rank-prefix"))
    running = dj.start_all()
    with pytest.raises(AssertionError, match="backoffLimit hit") as failed:
        dj.run_until_complete(running, timeout_s=JOB_TIMEOUT_S)
    report = str(failed.value)
    assert "first failing: pod 1 exited 1; last lines of its log:" in report, report
    assert "[rank 1] ValueError: You set devices=2 but this node has 1. HINT: Set devices=1" in report, report
    last = report.splitlines()[-1]  # the pod's last line names the rank and its error; torchrun's report is gone
    assert last.startswith("  launch: devices_mismatch.py failed: rank 1: ValueError: You set devices=2"), report
    assert "ChildFailedError" not in report, report


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=[pytest.mark.extended] if k == "pkg" else []) for k in sorted(USER_PROJECTS)]
)  # CI: the script in pods; the package in CI on launch.local and Slurm (test_namespace_fresh_interpreters.py, test_namespace_on_slurm.py)
def test_user_project_with_its_own_train_runs_in_pods(make_program_job, kind: str) -> None:
    """tests/integration/test_namespace_fresh_interpreters.py's user projects (their own train.py / train/ package, utils, models) as
    the pods' code: each pod runs it from /shared/code, imports the project's modules, finds nothing of
    ours under their names, and the two pods train together."""
    program, _ = USER_PROJECTS[kind]
    name = f"uproj-{kind}"
    dj = make_program_job(name, *program, "--out", f"/shared/out-{name}", project=PROGRAMS_DIR / f"userproj_{kind}")
    dj.run_until_complete(dj.start_all())
    assert sorted(dj.history) == [(0, OK), (1, OK)], dj.history
    seen = [json.loads(p.read_text()) for p in sorted((dj.shared / f"out-{name}").glob("rank*.json"))]
    installed = seen[0]["at_start"]["torchlaunch"]
    assert installed.startswith("/opt/venv/"), installed  # the image's install, not a copy on the volume
    site = str(Path(installed).parents[1])
    ours = tuple(f"{site}/{package}/" for package in ("torchlaunch", "train", "launch")) + ("/app/",)
    assert_user_world(seen, kind, CODE_DIR, ours)
