"""test_emit_manifest_validate: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/unit/test_emit.py.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import scanner
from tests.unit.test_emit import header_for, hostile_manifests
from torchlaunch.launch import emit


@pytest.mark.scanners
def test_manifest_with_hostile_values_passes_kubernetes_validate_strict(tmp_path):
    tool = scanner("kubernetes-validate")
    path = tmp_path / "job.yaml"
    objects = hostile_manifests("x\n---\nkind: ConfigMap #")
    path.write_text(emit.to_yaml(objects, header_for(["x\nkind: Secret"])))
    result = subprocess.run([str(tool), "--strict", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in (result.stdout + result.stderr).splitlines() if "passed for resource" in line]
    assert len(passed) == len(objects)  # exactly the objects built, no injected one
