"""Offline scanners on every manifest we render and on the Dockerfile: zero findings.

Waivers live next to what they waive: `checkov.io/skipN` annotations (rendered by launch.k8s with
their reason), `# checkov:skip=` / `# hadolint ignore=` comments in docker/Dockerfile.
Tools come from docker/tools.sh (their own venv); the tests skip, saying so, when it was not run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO as ROOT
from tests.conftest import launcher_argv, scanner

pytestmark = pytest.mark.scanners


# The default rendering, a multi-node GPU job pinned by digest in a namespace, and a CPU-only job.
RENDERINGS = {
    "default": [],
    "gpu-pinned": [
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--namespace",
        "ml",
        "--storage-class",
        "nfs",
        "--image",
        "reg.example/ddp@sha256:" + "0" * 64,
    ],
    "cpu": ["--nodes", "2", "--gpus-per-node", "1", "--cpu-only", "--config", "configs/smoke.yaml"],
    "elastic": ["--nodes", "1:4", "--max-restarts", "3"],
    "live": ["--nodes", "2", "--gpus-per-node", "8", "recovery.live=true"],
}
OBJECTS = 8
"""Objects per rendering: Service, NetworkPolicy, ConfigMap, PVC, Job, and the membership service's
NetworkPolicy, Service and Deployment: every multi-node rendering here is live, by default or named."""


@pytest.fixture(scope="module")
def manifest_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("manifests")
    files = {}
    for name, argv in RENDERINGS.items():
        out = subprocess.run(
            launcher_argv("torchlaunch.backends.k8s.launch", *argv),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        files[name] = folder / f"{name}.yaml"
        files[name].write_text(out.stdout)
    return files


def run_scanner(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, **env})


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_kubernetes_validate_strict(manifest_files, rendering):
    result = run_scanner([scanner("kubernetes-validate"), "--strict", str(manifest_files[rendering])])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == OBJECTS


def checkov(*paths: Path) -> subprocess.CompletedProcess[str]:
    args = [scanner("checkov"), "--quiet", "--compact", "--framework", "kubernetes", "dockerfile"]
    for p in paths:
        args += ["-f", str(p)]
    # BC_SKIP_MAPPING: no network look-ups; the scan itself is offline.
    return run_scanner(args, BC_SKIP_MAPPING="TRUE")


def test_checkov_manifests_and_dockerfile(manifest_files):
    result = checkov(*manifest_files.values(), ROOT / "docker" / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Failed checks: 0" in result.stdout and "Failed checks: " in result.stdout


def test_checkov_catches_a_privileged_pod(tmp_path):
    """The scan can fail: the same manifest with root and privilege escalation is rejected."""
    text = (ROOT / "k8s" / "job.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true"))
    result = checkov(bad)
    assert result.returncode != 0 and "CKV_K8S_20" in result.stdout


def test_hadolint_dockerfile():
    result = run_scanner([scanner("hadolint"), str(ROOT / "docker" / "Dockerfile")])
    assert result.returncode == 0, result.stdout + result.stderr
