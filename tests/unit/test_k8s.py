"""launch.k8s: golden renderings, the Job's structure, the pod script's shell logic, the TCP wait."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO as ROOT
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.k8s import options as k8s_opts
from torchlaunch.exit_codes import BAD_INPUT, OK
from torchlaunch.launch.spec import JobSpec

GOLDEN = ROOT / "tests" / "golden"


def render(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)  # recipes are given relative to the repository, as users do
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = k8s.main(argv)
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def by_kind(text: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


def test_default_rendering_is_k8s_job_yaml():
    code, out, _ = render(["--dry-run"])
    assert code == OK
    assert out == (ROOT / "k8s" / "job.yaml").read_text(), (
        "k8s/job.yaml is stale: python -m launch.k8s --dry-run > k8s/job.yaml"
    )


def test_four_nodes_of_eight_gpus_matches_golden():
    argv = [
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--image",
        "reg.example/ddp:1.2",
        "--name",
        "cifar",
        "--storage-class",
        "nfs",
        "--storage-size",
        "1Ti",
        "--save-time-s",
        "90",
        "--namespace",
        "ml",
        "--config",
        "configs/cifar10.yaml",
        "train.epochs=5",
    ]
    code, out, _ = render(argv)
    assert code == OK
    assert out == (GOLDEN / "k8s_4x8.yaml").read_text()


def spec_opts(**opts) -> tuple[JobSpec, k8s_opts.K8sOptions]:
    spec = JobSpec(config="configs/smoke.yaml", nodes=3, gpus_per_node=4, image="r/i:1", overrides=("seed=3",))
    return spec, k8s_opts.K8sOptions(name="run", **opts)


def test_indexed_job_pods_find_each_other_through_the_headless_service():
    spec, opts = spec_opts()
    objs = {m["kind"]: m for m in k8s_manifest.manifests(spec, opts, "seed: 0\n")}
    job, svc = objs["Job"]["spec"], objs["Service"]
    assert job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"] == 3
    pod = job["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "run"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == job["template"]["metadata"]["labels"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == "run-0.run"  # hostname <job>-<index> in subdomain <service>
    assert objs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert objs["ConfigMap"]["data"] == {"smoke.yaml": "seed: 0\n"}
    policy = objs["NetworkPolicy"]["spec"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": job["template"]["metadata"]["labels"]}}]}]


def test_failure_policy_retries_preemption_and_fails_fast_on_bad_input():
    spec, opts = spec_opts(save_time_s=100, step_time_s=20)
    job = k8s_manifest.job(spec, opts)["spec"]
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}} in rules
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert job["backoffLimit"] == 9
    assert pod["terminationGracePeriodSeconds"] == 150  # step + save + 30 s teardown


def test_least_privilege_and_resources():
    spec, opts = spec_opts()
    pod = k8s_manifest.pod_spec(spec, opts)
    c = pod["containers"][0]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    cpu_pod = k8s_manifest.pod_spec(spec, k8s_opts.K8sOptions(cpu_only=True))
    assert "nvidia.com/gpu" not in cpu_pod["containers"][0]["resources"]["limits"]
    assert "tolerations" not in cpu_pod


def run_pod_script(tmp_path: Path, index: int, spec: JobSpec, opts: k8s_opts.K8sOptions) -> list[str]:
    """Run the pod's real shell program with `python` replaced by a recorder of its argv."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    log = tmp_path / f"calls-{index}"
    (fake / "python").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (fake / "python").chmod(0o755)
    env = {
        "PATH": f"{fake}:/usr/bin:/bin",
        "JOB_COMPLETION_INDEX": str(index),
        "MASTER_ADDR": "run-0.run",
        "MASTER_PORT": "29500",
    }
    subprocess.run(["/bin/sh", "-c", k8s_manifest.pod_script(spec, opts)], env=env, check=True, timeout=30)
    return log.read_text().splitlines()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--name", "Bad_Name"], "--name"),
        (["--config", "configs/nope.yaml"], "cannot read --config"),
        (["train.epochs=-1"], "train.epochs"),
        (["run_dir=/elsewhere"], "--run-dir"),
        (["--run-dir", "/tmp/x"], "under /shared/"),
        (["--nodes", "0"], "--nodes"),
        (["--save-time-s", "0"], "--save-time-s"),
        (["--wait-for", "no-port"], "HOST:PORT"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    code, out, err = render(argv)
    assert code == BAD_INPUT and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_doctor_mode_runs_the_preflight_once():
    code, out, _ = render(["--dry-run", "--doctor", "--cpu-only", "--config", "configs/smoke.yaml"])
    assert code == OK
    job = by_kind(out)["Job"]
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--doctor" in script and "preemption.lead_time_s=" in script
    assert job["spec"]["backoffLimit"] == 0
