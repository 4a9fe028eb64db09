"""launch.k8s refuses what the API server would reject (exit 2, one line) and carries user text only through
launch.emit: hostile text never adds a YAML object, and every rendering passes `kubernetes-validate --strict`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import scanner
from tests.unit.test_k8s import render
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.k8s import options as k8s_opts
from torchlaunch.exit_codes import BAD_INPUT
from torchlaunch.jobs import record
from torchlaunch.launch.spec import JobSpec

EVIL = "x\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: evil\n#"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--namespace", "Prod"], "--namespace 'Prod': must be a DNS-1123 label"),
        (["--storage-size", "lots"], "--storage-size 'lots'"),
        (["--master-port", "0"], "--master-port must be a port number in 1..65535, got 0"),
        (["--master-port", "70000"], "--master-port must be a port number in 1..65535, got 70000"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--image", "reg example/img"], "--image"),
        (["--image", ""], "--image ''"),
        (["--image", "img\nkind: ConfigMap"], "--image"),
        (["--run-dir", "/shared/../tmp/run"], "resolves to /tmp/run"),
        (["--storage-class", "Fast_NFS"], "--storage-class"),
    ],
)
def test_values_the_api_server_rejects_are_refused(argv: list[str], needle: str) -> None:
    code, out, err = render(argv)
    assert code == BAD_INPUT and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def kinds(text: str) -> list[str]:
    return [d["kind"] for d in yaml.safe_load_all(text) if d]


def strict_validate(text: str, tmp_path: Path) -> None:
    tool = scanner("kubernetes-validate")
    path = tmp_path / "rendered.yaml"
    path.write_text(text)
    done = subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_pods_know_their_job_and_namespace_for_launch_status() -> None:
    spec = JobSpec(config="configs/smoke.yaml", nodes=2, gpus_per_node=1)
    env = {e["name"]: e for e in k8s_manifest.container(spec, k8s_opts.K8sOptions(name="run"))["env"]}
    assert env[record.K8S_JOB_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['batch.kubernetes.io/job-name']"
    )
    assert env[record.K8S_NAMESPACE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_the_run_dir_is_normalised_onto_the_shared_volume() -> None:
    spec = JobSpec(config="configs/smoke.yaml", run_dir="/shared/runs/../runs/a/./b")
    assert k8s_opts.run_dir(spec, k8s_opts.K8sOptions()) == "/shared/runs/a/b"
