"""Live recovery on the Kubernetes rendering, run in Docker (no cluster can run here): the rendered
Lighthouse Deployment becomes a container reached as `<name>-lighthouse` (its Service's name), each
pod of the Indexed Job a container read off the manifest (tests/engines/test_docker_job.py's DockerJob),
and the Job controller a small loop that applies the live Job's own policy: podFailurePolicy,
backoffLimitPerIndex, successPolicy. One pod is SIGKILLed whole (`docker kill`: every process of the
pod at once, as a lost node takes them); the controller replaces it; the replacement's launcher finds
the job training and its rank joins the live group with the survivor's state, in the same pod-0
process. Every step's samples, crops and flips equal an uninterrupted run's. Kubernetes' API server,
scheduler and kubelet are the part that is not real.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import live
from tests.conftest import REPO as ROOT
from tests.conftest import launcher_argv
from tests.engines.test_docker_job import DockerJob, docker, image, shared_folder  # noqa: F401
from tests.integration.test_live_recovery import step_samples
from torchlaunch import config as config_mod
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.backends.k8s import live as k8s_live
from torchlaunch.exit_codes import OK
from torchlaunch.launch.spec import JobSpec

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

OVERRIDES = (
    "train.epochs=4",
    "train.batch_size=16",
    "data.synthetic_val_size=64",
    "train.log_every_steps=8",
    "checkpoint.every_steps=64",
    "debug.trace_batches=true",
    "recovery.live=true",
    "recovery.heartbeat_timeout_s=1",
)
"""The smoke recipe, 4 epochs of 128 steps: a replaced pod's rank joins ~40 steps after the kill here."""
KILL_AT = 40
DEADLINE_S = 600.0


@dataclass
class LiveJob(DockerJob):
    """The live rendering's pods, its Lighthouse, and the live Job's failure policy."""

    lighthouse: str = ""
    """The Lighthouse pod's container."""

    def start_lighthouse(self, deployment: dict) -> None:
        """The Deployment's one pod, named as its Service is, read off the manifest as the Job's pods are."""
        pod = deployment["spec"]["template"]["spec"]
        c = pod["containers"][0]
        sc = c["securityContext"]
        name = deployment["metadata"]["name"]
        argv = ["run", "-d", "--name", f"{self.prefix}-{name}", "--network", self.network]
        argv += ["--network-alias", name, "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--cap-drop", "ALL"]
        argv += ["--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp:rw,mode=1777"]
        for env in c.get("env", []):
            argv += ["-e", f"{env['name']}={env['value']}"]
        argv += ["--entrypoint", c["command"][0], c["image"], *c["command"][1:], *c["args"]]
        docker(*argv)
        self.lighthouse = f"{self.prefix}-{name}"
        deadline = time.monotonic() + 120
        while "lighthouse: serving" not in self.lighthouse_log():
            status = docker("inspect", "-f", "{{.State.Status}}", self.lighthouse).stdout.strip()
            assert status == "running", f"the Lighthouse pod ended:\n{self.lighthouse_log()[-3000:]}"
            assert time.monotonic() < deadline, f"the Lighthouse never served:\n{self.lighthouse_log()[-3000:]}"
            time.sleep(0.2)  # polling a container's log, bounded by the deadline

    def lighthouse_log(self) -> str:
        done = docker("logs", self.lighthouse, check=False)
        return done.stdout + done.stderr

    def run_live(self, running: set[int], kill: int) -> None:
        """The controller: replace an ended pod by the policy (per-index budget), until the success
        policy holds and every pod has ended; SIGKILL pod `kill` once its rank traced KILL_AT."""
        spec = self.job["spec"]
        needed = spec["successPolicy"]["rules"][0]["succeededCount"]
        failures = dict.fromkeys(range(spec["completions"]), 0)
        succeeded: set[int] = set()
        killed = False
        deadline = time.monotonic() + DEADLINE_S
        trace = self.run_dir / "trace" / f"rank{kill}.jsonl"
        while running or len(succeeded) < needed:
            assert time.monotonic() < deadline, f"the job did not complete: {self.history}\n{self.all_logs()}"
            if not killed and live.traced_step(trace) >= KILL_AT:
                docker("kill", self.container(kill))  # SIGKILL to the pod's init: every process of it
                killed = True
            for index, code in self.ended(running):
                if code == OK:
                    succeeded.add(index)
                    continue
                action = self.action(code)
                if action == "FailIndex":
                    continue
                if action == "Count":
                    failures[index] += 1
                    if failures[index] > spec["backoffLimitPerIndex"]:
                        continue
                self.start(index)
                running.add(index)
            time.sleep(0.2)  # polling container states, bounded by the deadline above

    def all_logs(self) -> str:
        return "\n".join(f"--- pod {i}\n{self.logs(i)[-3000:]}" for i in range(self.job["spec"]["completions"]))

    def cleanup(self) -> None:
        if self.lighthouse:
            docker("rm", "-f", self.lighthouse, check=False)
        super().cleanup()


@pytest.fixture
def live_job(image, tmp_path: Path):  # noqa: F811 - the session fixture imported above
    spec = JobSpec(config="configs/smoke.yaml", nodes=2, gpus_per_node=1, image=image, overrides=OVERRIDES)
    cfg = config_mod.load(str(ROOT / "configs" / "smoke.yaml"), list(OVERRIDES))
    opts = k8s.K8sOptions(
        name="lv", cpu_only=True, save_time_s=20, step_time_s=10, live=k8s_live.from_config(cfg.recovery, False)
    )
    recipe = (ROOT / "configs" / "smoke.yaml").read_text()
    objects = k8s.manifests(spec, opts, recipe)
    job = next(m for m in objects if m["kind"] == "Job")
    deployment = next(m for m in objects if m["kind"] == "Deployment")
    recipe_dir = tmp_path / "recipe"
    recipe_dir.mkdir()
    (recipe_dir / "smoke.yaml").write_text(recipe)
    tmp_path.chmod(0o755)
    recipe_dir.chmod(0o755)
    prefix = "tl" + uuid.uuid4().hex[:6]
    dj = LiveJob(job, recipe_dir, shared_folder(tmp_path / "shared"), prefix, network=f"{prefix}-net")
    docker("network", "create", dj.network)
    try:
        dj.start_lighthouse(deployment)
        yield dj
    finally:
        dj.cleanup()


def reference_run(work: Path) -> Path:
    """The same recipe uninterrupted on this host (2 ranks, one node): the plan, so every step's samples,
    crops and flips, does not depend on where the ranks run or how many there are."""
    run_dir = work / "ref"
    overrides = [o for o in OVERRIDES if not o.startswith("recovery.")]
    argv = launcher_argv("launch.local", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml")
    done = subprocess.run(
        [*argv, *overrides, f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_pod_killed_whole_is_replaced_by_the_job_and_joins_the_live_group(live_job: LiveJob, tmp_path: Path) -> None:
    dj = live_job
    dj.run_live(dj.start_all(), kill=1)
    out = dj.all_logs()
    assert dj.history[0] == (1, 137), dj.history  # the SIGKILLed pod, then both finish
    assert sorted(dj.history[1:]) == [(0, OK), (1, OK)], f"{dj.history}\n{out}"
    assert "launch: this job trains already on its other nodes" in dj.logs(1), out
    assert "live: joined the group at global step" in dj.logs(1), out
    assert "resumed from" not in out, "a pod was restarted from a checkpoint"
    assert "live: lost 1 rank(s)" in dj.logs(0), out  # pod 0's rank regrouped in its own process
    assert step_samples(dj.run_dir) == step_samples(reference_run(tmp_path))
    assert (dj.run_dir / "model.pt").is_file()
