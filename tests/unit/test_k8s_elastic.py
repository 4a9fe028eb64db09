"""launch.k8s --nodes MIN:MAX (an elastic Indexed Job) and --jobset (a JobSet around the same Job): golden
renderings, the elastic pieces of the Job, and schema validation where the schemas exist offline (no API
server runs here: the batch/v1 Job, also the JobSet's embedded one, against kubernetes-validate's schemas;
the JobSet's own fields by structure, since no JobSet schema is available offline)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO as ROOT
from tests.conftest import scanner
from tests.unit.test_k8s import GOLDEN, by_kind, render
from torchlaunch.exit_codes import BAD_INPUT, OK

ELASTIC = ["--nodes", "1:4", "--max-restarts", "3", "--gpus-per-node", "8", "--name", "el", "--image", "r/i:1"]
RESTART = "recovery.live=false"
"""These tests' subject is the restart road's elastic Job (torchrun's rendezvous); the default is live."""


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; if intended, UPDATE_GOLDEN=1 and review {path}"


def test_elastic_job_golden_and_its_pieces() -> None:
    code, out, err = render([*ELASTIC, RESTART])
    assert code == OK, err
    golden("k8s_elastic.yaml", out)
    job = by_kind(out)["Job"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4  # MAX; patch both to scale
    assert job["spec"]["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--nnodes 1:4 " in script and "--node-rank" not in script and "--max-restarts 3" in script
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == "el-0.el"
    rules = job["spec"]["podFailurePolicy"]["rules"]  # a lost node's pod is replaced, not counted
    assert {"type": "DisruptionTarget", "status": "True"} in rules[2]["onPodConditions"]


def test_jobset_golden_and_its_pieces() -> None:
    code, out, err = render([*ELASTIC, "--jobset", "--jobset-max-restarts", "5", RESTART])
    assert code == OK, err
    golden("k8s_jobset.yaml", out)
    kinds = [doc["kind"] for doc in yaml.safe_load_all(out)]
    assert kinds == ["NetworkPolicy", "ConfigMap", "PersistentVolumeClaim", "JobSet"]  # the JobSet makes the Service
    jobset = by_kind(out)["JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    spec = jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "el", "publishNotReadyAddresses": True}
    assert spec["failurePolicy"] == {
        "maxRestarts": 5,
        "rules": [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
    }
    [replicated] = spec["replicatedJobs"]
    assert (replicated["name"], replicated["replicas"]) == ("node", 1)
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert pod["subdomain"] == "el"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == "el-node-0-0.el"  # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>


def test_default_rendering_is_unchanged_by_the_elastic_code() -> None:
    code, out, _ = render(["--dry-run"])
    assert code == OK and out == (ROOT / "k8s" / "job.yaml").read_text()
    assert "succeededIndexes" not in out and "--node-rank" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nodes", "1:4", RESTART], "--nodes 1:4 with --max-restarts 0"),
        (["--nodes", "4:1", "--max-restarts", "1"], "MIN 4 is more than MAX 1"),
        (["--nodes", "0:2", "--max-restarts", "1"], "--nodes must be >= 1, got 0"),
        (["--nodes", "x"], "pass a node count N or a range MIN:MAX"),
        (["--jobset", "--name", "a" * 55, "--nodes", "100"], "is too long for --jobset"),
        (["--jobset", "--jobset-max-restarts", "-1"], "--jobset-max-restarts must be in 0..1000"),
    ],
)
def test_bad_elastic_input_is_one_line(argv: list[str], needle: str) -> None:
    code, out, err = render(argv)
    assert code == BAD_INPUT and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def validate(tmp_path: Path, docs: list[dict]) -> str:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [scanner("kubernetes-validate"), "--strict", "-k", "1.31.0", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
