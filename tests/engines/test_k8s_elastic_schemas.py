"""test_k8s_elastic_schemas: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/unit/test_k8s_elastic.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.unit.test_k8s import by_kind, render
from tests.unit.test_k8s_elastic import ELASTIC, RESTART, validate


@pytest.mark.scanners
def test_elastic_job_passes_the_kubernetes_1_31_schemas(tmp_path: Path) -> None:
    """1.31: the first release where a Job's parallelism and completions may be patched (ElasticIndexedJob)."""
    _, out, _ = render([*ELASTIC, RESTART])  # the restart road's Job (the default renders live)
    assert validate(tmp_path, list(yaml.safe_load_all(out))).count("passed") == 5


@pytest.mark.scanners
def test_jobset_embedded_job_passes_the_job_schema(tmp_path: Path) -> None:
    _, out, _ = render([*ELASTIC, "--jobset"])
    template = by_kind(out)["JobSet"]["spec"]["replicatedJobs"][0]["template"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "el-node-0", **template["metadata"]}}
    job["spec"] = template["spec"]
    assert validate(tmp_path, [job]).count("passed") == 1


@pytest.mark.scanners
def test_checkov_finds_nothing_in_the_jobset(tmp_path: Path) -> None:
    from tests.engines.test_k8s_scanners import checkov

    _, out, _ = render([*ELASTIC, "--jobset"])
    path = tmp_path / "jobset.yaml"
    path.write_text(out)
    result = checkov(path)
    assert result.returncode == 0 and "Failed checks: 0" in result.stdout, result.stdout + result.stderr
