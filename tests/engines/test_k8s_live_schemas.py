"""test_k8s_live_schemas: the tests on the engines floor (they need the scanners). The rest of them, and the
helpers both halves share, are in tests/unit/test_k8s_live.py; test_k8s_scanners checks the default
live rendering with the other renderings (kubernetes-validate --strict against the newest schemas, checkov).

No API server runs here: the live rendering's Deployment and Service, and the Job's per-index failure
policy and success policy, are checked against the Kubernetes 1.31 schemas (backoffLimitPerIndex and
successPolicy beta and on by default there, GA in 1.33)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.engines.test_k8s_scanners import checkov
from tests.unit.test_k8s import render
from tests.unit.test_k8s_elastic import validate
from tests.unit.test_k8s_live import LIVE
from tests.unit.test_k8s_wiring import EVIL, kinds
from torchlaunch.exit_codes import BAD_INPUT

pytestmark = pytest.mark.scanners


def test_live_rendering_passes_the_kubernetes_1_31_schemas(tmp_path: Path) -> None:
    _, out, _ = render([*LIVE, "--backoff-limit", "2"])
    report = validate(tmp_path, list(yaml.safe_load_all(out)))
    for kind in ("deployment/lv-lighthouse", "service/lv-lighthouse", "networkpolicy/lv-lighthouse", "job/lv"):
        assert f"passed for resource {kind} " in report, report
    assert report.count("passed") == 8


def test_checkov_finds_nothing_in_the_live_rendering_pinned_or_tagged(tmp_path: Path) -> None:
    for name, extra in (("tagged", []), ("pinned", ["--image", "reg.example/ddp@sha256:" + "0" * 64])):
        _, out, _ = render([*LIVE, *extra])
        path = tmp_path / f"{name}.yaml"
        path.write_text(out)
        result = checkov(path)
        assert result.returncode == 0 and "Failed checks: 0" in result.stdout, result.stdout + result.stderr


def test_a_hostile_override_beside_live_mode_adds_no_object(tmp_path: Path) -> None:
    """User text beside the service's address stays one shell word in one YAML string."""
    hostile = [*LIVE, "--config", "configs/smoke.yaml", "data.name=imagefolder", f"data.root={EVIL}"]
    code, out, err = render(hostile)
    if code == BAD_INPUT:  # the recipe refused the value itself: nothing rendered at all
        assert out == "" and len(err.strip().splitlines()) == 1, err
        return
    _, plain, _ = render([*LIVE, "--config", "configs/smoke.yaml", "data.name=imagefolder", "data.root=x"])
    assert kinds(out) == kinds(plain) and len(kinds(out)) == 8
    assert "evil" not in [d["metadata"]["name"] for d in yaml.safe_load_all(out) if d]
    assert validate(tmp_path, list(yaml.safe_load_all(out))).count("passed") == 8
