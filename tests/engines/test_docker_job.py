"""The image and the Kubernetes Job, exercised with a real Docker engine (no cluster can run here).

Each pod of the rendered Indexed Job becomes a container built from the manifest itself: the same
image, command, args, env (plus JOB_COMPLETION_INDEX, which the Job controller injects), user,
read-only root, dropped capabilities, working dir and mounts. The headless Service becomes a
user-defined network on which pod i answers to `<job>-<i>` and `<job>-<i>.<service>`; one host folder
stands in for the ReadWriteMany PVC and one for the ConfigMap. The Job controller is mimicked by a
small loop that applies the manifest's podFailurePolicy and backoffLimit and replaces finished pods
only once they have exited (podReplacementPolicy: Failed). Kubernetes' own API server, scheduler and
kubelet are the part that is not real here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO as ROOT
from tests.conftest import launcher_argv
from tests.helpers import assert_models_equal
from torchlaunch.backends.k8s import hardening
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.k8s import options as k8s_opts
from torchlaunch.exit_codes import BAD_INPUT, OK, PREEMPTED
from torchlaunch.launch.spec import JobSpec

pytestmark = [pytest.mark.docker, pytest.mark.slow]

DOCKER = os.environ.get("DOCKER", "/usr/bin/docker")
IMAGE = os.environ.get("TORCHLAUNCH_IMAGE", "torchlaunch:dev")
RUN_AS = hardening.RUN_AS
EPOCHS = 4  # 64 steps at world size 2: long enough to stop in the middle, short enough for CI
JOB_TIMEOUT_S = 600


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=check)


def engine_answers() -> bool:
    if not Path(DOCKER).exists():
        return False
    try:
        return docker("info", timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


_BUILT: list[str] = []
"""The image once built in this session. Each module that imports `image` gets a session fixture of its own
(pytest keys a fixture by where it is defined for that module), so without this the build script ran once
per importing module: four times in CI's serial stage, ~10-40 s each with every layer cached."""


@pytest.fixture(scope="session")
def image() -> str:
    """The image, built (or confirmed up to date: cached layers, seconds) by the CI build script, once."""
    if not engine_answers():
        pytest.skip("no Docker engine answers: start one with docker/engine.sh up")
    if os.geteuid() != 0:
        pytest.skip("needs root: the shared volume is handed to the image's uid like fsGroup does")
    if not _BUILT:
        result = subprocess.run(
            [str(ROOT / "docker" / "build-image.sh"), "--local", IMAGE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        _BUILT.append(IMAGE)
    return IMAGE


def shared_folder(path: Path) -> Path:
    """A host folder standing in for a PVC mounted with fsGroup: writable by the image's user."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, RUN_AS, RUN_AS)
    return path


def load_model(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


# ---- the image ---------------------------------------------------------------------------------------


def test_image_metadata(image):
    info = json.loads(docker("image", "inspect", image).stdout)[0]
    assert info["Config"]["User"] == f"{RUN_AS}:{RUN_AS}"
    assert info["Config"]["Entrypoint"] == ["/usr/bin/tini", "--"]
    labels = info["Config"]["Labels"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert labels["org.opencontainers.image.revision"] == head.stdout.strip()
    assert labels["org.opencontainers.image.version"]


def test_code_change_rebuilds_from_cached_dependencies(image, tmp_path):
    """Only the code layers rebuild: no wheel server is running, so pip would fail if it ran."""
    context = tmp_path / "ctx"
    shutil.copytree(ROOT, context, ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "runs", "__pycache__"))
    with (context / "launch" / "__init__.py").open("a") as f:
        f.write(f"\n# rebuild probe {uuid.uuid4().hex}\n")
    tag = f"torchlaunch-probe:{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    result = subprocess.run(
        [
            DOCKER,
            "build",
            "--network",
            "host",
            "-f",
            "docker/Dockerfile",
            "-t",
            tag,
            "--build-arg",
            "BASE_IMAGE=" + os.environ.get("BASE_LOCAL", "local/bookworm-python:1"),
            "--build-arg",
            "WHEELHOUSE_URL=http://127.0.0.1:" + os.environ.get("WHEELHOUSE_PORT", "38421") + "/",
            ".",
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DOCKER_BUILDKIT": "1"},
    )
    elapsed = time.monotonic() - start
    docker("rmi", "-f", tag, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert elapsed < 60, f"rebuild after a code change took {elapsed:.0f}s"


def test_container_runs_smoke_as_non_root(image, tmp_path):
    shared = shared_folder(tmp_path / "shared")
    result = docker(
        "run",
        "--rm",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "-v",
        f"{shared}:/shared",
        image,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == OK, result.stdout[-2000:] + result.stderr[-2000:]
    model = shared / "runs" / "smoke" / "model.pt"
    assert model.stat().st_uid == RUN_AS  # written by the image's user, not root
    assert load_model(model)


# ---- the Job, pod by pod ---------------------------------------------------------------------------------


@dataclass
class DockerJob:
    """The rendered Job's pods as containers, and a stand-in for the Job controller."""

    job: dict
    recipe_dir: Path
    shared: Path
    prefix: str
    network: str = ""
    failures: int = 0
    history: list[tuple[int, int]] = field(default_factory=list)
    """(index, exit code) of every pod that ended, in order."""
    first_failure: str | None = None
    """The first pod that failed (not a preemption): its index, exit code and log tail, for the assertion."""
    extra: list[str] = field(default_factory=list)
    """`docker run` options beyond the manifest's: a test's own mounts and env (its data, a test model)."""

    @property
    def name(self) -> str:
        return self.job["metadata"]["name"]

    @property
    def pod(self) -> dict:
        return self.job["spec"]["template"]["spec"]

    @property
    def grace_s(self) -> int:
        return self.pod["terminationGracePeriodSeconds"]

    @property
    def run_dir(self) -> Path:
        return self.shared / "runs" / self.name

    def container(self, index: int) -> str:
        return f"{self.prefix}-{self.name}-{index}"

    def env_value(self, env: dict) -> str:
        """A plain value, or what the downward API would give for the fields the manifest asks for."""
        if "value" in env:
            return env["value"]
        field = env["valueFrom"]["fieldRef"]["fieldPath"]
        known = {"metadata.labels['batch.kubernetes.io/job-name']": self.name, "metadata.namespace": "default"}
        assert field in known, f"the test does not emulate the downward API field {field}"
        return known[field]

    def pod_argv(self, index: int) -> list[str]:
        """`docker run` for pod `index`, read off the manifest."""
        c = self.pod["containers"][0]
        sc = c["securityContext"]
        hostname = f"{self.name}-{index}"
        argv = [
            "run",
            "-d",
            "--name",
            self.container(index),
            "--network",
            self.network,
            "--hostname",
            hostname,
            "--network-alias",
            hostname,
            "--network-alias",
            f"{hostname}.{self.pod['subdomain']}",
            "--user",
            f"{sc['runAsUser']}:{sc['runAsGroup']}",
            "--cap-drop",
            "ALL",
            "--workdir",
            c["workingDir"],
            "--entrypoint",
            c["command"][0],
            "-e",
            f"JOB_COMPLETION_INDEX={index}",
        ]
        if not sc["allowPrivilegeEscalation"]:
            argv += ["--security-opt", "no-new-privileges"]
        if sc["readOnlyRootFilesystem"]:
            argv.append("--read-only")
        for env in c["env"]:
            argv += ["-e", f"{env['name']}={self.env_value(env)}"]
        argv += ["-e", "KUBERNETES_SERVICE_HOST=10.0.0.1"]  # what the kubelet sets in every pod
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        for mount in c["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                argv += ["-v", f"{self.recipe_dir}:{mount['mountPath']}:ro"]
            elif "persistentVolumeClaim" in volume:
                argv += ["-v", f"{self.shared}:{mount['mountPath']}"]
            elif mount["mountPath"] == "/dev/shm":
                argv += ["--shm-size", volume["emptyDir"]["sizeLimit"].replace("Gi", "g")]
            else:
                argv += ["--tmpfs", f"{mount['mountPath']}:rw,mode=1777"]
        return argv + self.extra + [c["image"], *c["command"][1:], *c["args"]]

    def start(self, index: int) -> None:
        docker("rm", "-f", self.container(index), check=False)  # the old pod is gone before its replacement
        docker(*self.pod_argv(index))

    def state(self, index: int) -> tuple[str, int]:
        out = docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", self.container(index)).stdout.split()
        return out[0], int(out[1])

    def logs(self, index: int) -> str:
        result = docker("logs", self.container(index), check=False)
        return result.stdout + result.stderr

    def failure_report(self, index: int, code: int, lines: int = 20) -> str:
        """What `kubectl logs` of the first failed pod shows a user: its index, exit code and last lines
        (the pods' rank prefixes and tracebacks as the container wrote them)."""
        tail = [line for line in self.logs(index).splitlines() if line.strip()][-lines:]
        return f"pod {index} exited {code}; last lines of its log:\n" + "\n".join(f"  {line}" for line in tail)

    def action(self, code: int) -> str:
        """What the manifest's podFailurePolicy says about a pod that exited with `code`."""
        for rule in self.job["spec"]["podFailurePolicy"]["rules"]:
            on = rule.get("onExitCodes")
            if on and on["operator"] == "In" and code in on["values"]:
                return rule["action"]
        return "Count"

    def ended(self, running: set[int]) -> list[tuple[int, int]]:
        """The pods of `running` that have exited since the last look, with their codes: taken out of
        `running` and recorded in the history."""
        found = []
        for index in sorted(running):
            status, code = self.state(index)
            if status == "exited":
                self.history.append((index, code))
                running.discard(index)
                found.append((index, code))
        return found

    def run_until_complete(self, running: set[int], timeout_s: float = JOB_TIMEOUT_S) -> None:
        """Replace ended pods by the policy until every index has succeeded once (or the Job fails)."""
        nodes = self.job["spec"]["completions"]
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < nodes:
            assert time.monotonic() < deadline, f"job did not complete in {timeout_s}s: {self.history}"
            for index, code in self.ended(running):
                if code == OK:
                    done.add(index)
                    continue
                action = self.action(code)
                if action != "Ignore" and self.first_failure is None:
                    self.first_failure = self.failure_report(index, code)
                if action == "FailJob":
                    raise AssertionError(f"FailJob: {self.first_failure}")
                if action == "Count":
                    self.failures += 1
                    if self.failures > self.job["spec"]["backoffLimit"]:
                        raise AssertionError(f"backoffLimit hit: {self.history}; first failing: {self.first_failure}")
                self.start(index)
                running.add(index)
            time.sleep(0.5)  # polling container states; every loop is bounded by the deadline above

    def start_all(self) -> set[int]:
        nodes = self.job["spec"]["completions"]
        for index in range(nodes):
            self.start(index)
        return set(range(nodes))

    def cleanup(self) -> None:
        for index in range(self.job["spec"]["completions"]):
            docker("rm", "-f", self.container(index), check=False)
        docker("network", "rm", self.network, check=False)


@pytest.fixture(scope="module")
def make_job(image, tmp_path_factory):
    """Jobs of two CPU pods running the smoke recipe; every container and network is removed at the end."""
    jobs: list[DockerJob] = []

    def make(name: str, *overrides: str, extra: Sequence[str] = (), **options: Any) -> DockerJob:
        """`options`: K8sOptions fields other than the defaults below; `extra`: DockerJob.extra."""
        spec = JobSpec(
            config="configs/smoke.yaml",
            nodes=2,
            gpus_per_node=1,
            image=image,
            # the restart road's Job (opts.live None; the live Job is test_docker_live.py's): its pods told so,
            # as launch.k8s tells a rendering it did not make live (backends.k8s.live.pinned)
            overrides=(f"train.epochs={EPOCHS}", "recovery.live=false", *overrides),
        )
        opts = k8s_opts.K8sOptions(**{"name": name, "cpu_only": True, "save_time_s": 20, "step_time_s": 10, **options})
        recipe = (ROOT / "configs" / "smoke.yaml").read_text()
        job = next(m for m in k8s_manifest.manifests(spec, opts, recipe) if m["kind"] == "Job")
        folder = tmp_path_factory.mktemp(name)
        recipe_dir = folder / "recipe"
        recipe_dir.mkdir()
        (recipe_dir / "smoke.yaml").write_text(recipe)
        folder.chmod(0o755)
        recipe_dir.chmod(0o755)
        dj = open_job(job, recipe_dir, shared_folder(folder / "shared"), jobs)
        dj.extra = list(extra)
        return dj

    yield make
    for dj in jobs:
        dj.cleanup()


@pytest.fixture(scope="module")
def uninterrupted(make_job) -> DockerJob:
    """The reference: the Job's two pods train end to end without interruption."""
    dj = make_job("ref")
    dj.run_until_complete(dj.start_all())
    return dj


def open_job(job: dict, recipe_dir: Path, shared: Path, jobs: list[DockerJob]) -> DockerJob:
    """A DockerJob with its own name prefix and network (the headless Service's stand-in), recorded
    in `jobs` so the fixture removes it."""
    prefix = "tl" + uuid.uuid4().hex[:6]
    dj = DockerJob(job, recipe_dir, shared, prefix)
    dj.network = f"{prefix}-net"
    docker("network", "create", dj.network)
    jobs.append(dj)
    return dj


def all_logs(dj: DockerJob) -> str:
    return "\n".join(dj.logs(i) for i in range(dj.job["spec"]["completions"]))


def wait_for_log_line(dj: DockerJob, prefix: str, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [ln for ln in all_logs(dj).splitlines() if ln.startswith(prefix)]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no log line {prefix!r} within {timeout_s}s:\n{all_logs(dj)[-3000:]}"
        time.sleep(0.2)  # polling container logs, bounded by the deadline


def test_job_trains_end_to_end_with_two_pods(uninterrupted):
    dj = uninterrupted
    assert dj.history and all(code == OK for _, code in dj.history) and len(dj.history) == 2
    lines = [json.loads(ln) for ln in (dj.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(ln["step"] for ln in lines) == EPOCHS * 16  # 2048 images / global batch 128
    assert "starting simple_cnn on 2 x cpu" in all_logs(dj)
    assert (dj.run_dir / "model.pt").exists()


def test_launch_status_of_the_pods_run_dir_names_the_job(uninterrupted):
    from torchlaunch.jobs import record

    dj = uninterrupted
    assert record.read_all(dj.run_dir)[0], f"no job record in {dj.run_dir}/job: the pods' launch.local writes one"
    done = subprocess.run(
        launcher_argv("launch", "status", str(dj.run_dir), "--json"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["scheduler"], data["job_id"], data["state"]) == ("k8s", dj.name, "finished")


def wait_for_checkpoint(dj: DockerJob, min_step: int, timeout_s: float = 300) -> None:
    marker = dj.run_dir / "checkpoints" / f"step-{min_step:09d}" / "COMMITTED.json"
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        for index in (0, 1):
            status, code = dj.state(index)
            assert status == "running", f"pod {index} ended ({code}) before step {min_step}:\n{dj.logs(index)[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint at step {min_step} within {timeout_s}s"
        time.sleep(0.2)  # polling a file on the shared volume, bounded by the deadline


@pytest.mark.parametrize(
    "stopped",
    [pytest.param(1, marks=pytest.mark.extended, id="pod1"), pytest.param(0, id="pod0-rendezvous-host")],
)  # the rendezvous host is the harder stop; stopping the other pod is the extended tier's
@pytest.mark.extended  # in CI: the rendezvous host's pod stopped mid-step within its grace, exit 75, not counted
# against backoffLimit, the job resumed exactly (test_outside_stops_schedulers.py's pod deletion, a long step too);
# a pod of the default rendering stopped within its rendered grace (test_docker_user_program.py's stopped pod)
def test_stopped_pod_checkpoints_within_grace_and_the_job_resumes_exactly(make_job, uninterrupted, stopped):
    dj = make_job(f"stop{stopped}")
    running = dj.start_all()
    wait_for_checkpoint(dj, 8)
    start = time.monotonic()
    docker("stop", "-t", str(dj.grace_s), dj.container(stopped), timeout=dj.grace_s + 30)
    took = time.monotonic() - start
    status, code = dj.state(stopped)
    assert (status, code) == ("exited", PREEMPTED), f"took {took:.1f}s:\n{dj.logs(stopped)[-3000:]}"
    assert took < dj.grace_s  # not SIGKILLed at the end of the grace period
    print(f"pod {stopped}: docker stop -t {dj.grace_s} returned after {took:.1f}s with exit {code}")
    committed = wait_for_log_line(dj, "preempted: checkpoint committed at global step")
    step = int(committed.split("global step ")[1].split()[0])
    assert (dj.run_dir / "checkpoints" / f"step-{step:09d}" / "COMMITTED.json").exists()
    assert step < EPOCHS * 16, "the stop came after the run had finished: nothing was interrupted"

    dj.run_until_complete(running)

    assert dj.failures == 0, f"a preemption must not count against backoffLimit: {dj.history}"
    resumed = wait_for_log_line(dj, "resumed from")
    assert f"step-{step:09d}" in resumed, resumed
    assert_models_equal(dj.run_dir / "model.pt", uninterrupted.run_dir / "model.pt")


def test_bad_input_fails_the_job_without_retry(make_job):
    dj = make_job("bad", "checkpoint.keep=1")  # rejected by config validation in every pod
    running = dj.start_all()
    with pytest.raises(AssertionError, match="FailJob"):
        dj.run_until_complete(running, timeout_s=300)
    assert dj.history and dj.history[0][1] == BAD_INPUT
