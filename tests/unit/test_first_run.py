"""What a new user's first commands met (issue 51, items 1, 3, 4, 5, 8 and part of 10), one test per
cause: the suite read the runs/ the quick start leaves, README examples shared a run dir with other
configs, and the commands' own words outside .venv. In-process; their subprocess halves are in
tests/integration/test_first_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import workdir
from tests.conftest import REPO, stage
from torchlaunch import config as config_mod
from torchlaunch.backends.local import launch as local
from torchlaunch.exit_codes import OK


def test_a_users_runs_folder_is_not_the_suites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The quick start leaves runs/smoke (another config than a test's); a test resolving the smoke
    recipe's default run dir must land in the session's own runs/, and a dry run there must pass."""
    cfg = config_mod.load("configs/smoke.yaml", [])
    assert not Path(cfg.run_dir).resolve().is_relative_to(REPO.resolve()), Path.cwd()
    assert stage() != REPO and (stage() / "configs" / "smoke.yaml").is_file()
    users = tmp_path / "checkout"
    (users / "runs" / "smoke").mkdir(parents=True)
    (users / "configs").mkdir()
    workdir.build(users, tmp_path / "stage")
    assert sorted(p.name for p in (tmp_path / "stage").iterdir()) == ["configs"]  # runs/ is never linked
    code = local.main(["--device", "cpu", "--config", "configs/smoke.yaml", "seed=7", "--dry-run"])
    assert code == OK, capsys.readouterr().err


def test_a_test_that_writes_the_checkouts_runs_is_named(tmp_path: Path) -> None:
    before = workdir.runs_listing(tmp_path)
    (tmp_path / "runs" / "smoke").mkdir(parents=True)
    problem = workdir.guard(before, workdir.runs_listing(tmp_path))
    assert problem is not None and "runs/smoke" in problem
    assert workdir.guard(workdir.runs_listing(tmp_path), workdir.runs_listing(tmp_path)) is None
    (tmp_path / "runs" / "faults").mkdir()  # `make faults` tells the suite to save its outcomes there
    told = {workdir.RESULTS_ENV: "runs/faults"}
    assert workdir.runs_listing(tmp_path, told) == workdir.runs_listing(tmp_path, {}) - {"faults"}
