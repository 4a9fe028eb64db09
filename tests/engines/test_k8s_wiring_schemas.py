"""test_k8s_wiring_schemas: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/unit/test_k8s_wiring.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.unit.test_k8s import render
from tests.unit.test_k8s_wiring import EVIL, kinds, strict_validate
from torchlaunch.exit_codes import BAD_INPUT, OK


@pytest.mark.parametrize(
    ("hostile", "plain"),
    [
        (["--", "train.py", "--note", EVIL], ["--", "train.py", "--note", "x"]),
        (["--name", "run", "--", "train.py", "--note", EVIL], ["--name", "run", "--", "train.py"]),
        (  # data.name: a synthetic recipe refuses a data.root it would not read
            ["--config", "configs/smoke.yaml", "data.name=imagefolder", f"data.root={EVIL}"],
            ["--config", "configs/smoke.yaml", "data.name=imagefolder"],
        ),
    ],
    ids=["program-argument", "program-named", "override"],
)
@pytest.mark.scanners
def test_hostile_text_adds_no_object_and_the_rendering_stays_valid(
    hostile: list[str], plain: list[str], tmp_path: Path
) -> None:
    code, out, err = render(hostile)
    if code == BAD_INPUT:  # the recipe refused the value itself: nothing rendered at all
        assert out == "" and len(err.strip().splitlines()) == 1, err
        return
    assert code == OK, err
    _, reference, _ = render(plain)
    assert kinds(out) == kinds(reference) == ["Service", "NetworkPolicy", *kinds(reference)[2:]]
    assert "evil" not in [d["metadata"]["name"] for d in yaml.safe_load_all(out) if d]
    strict_validate(out, tmp_path)


@pytest.mark.scanners
def test_a_hostile_image_is_refused_and_the_default_rendering_is_strictly_valid(tmp_path: Path) -> None:
    code, out, err = render(["--image", f"reg.example/img:1{EVIL}"])
    assert code == BAD_INPUT and out == "" and "--image" in err
    code, out, err = render(["--dry-run"])
    assert code == OK, err
    strict_validate(out, tmp_path)
