"""The suite's working directory: the checkout as the tests see it, without what a user's commands wrote.

Why: the README's quick start (`make train-local ... CONFIG=configs/smoke.yaml`) leaves runs/smoke in
the checkout, and a test that resolved a recipe's default run dir there read the user's run (a dry
run refused: "was started with another config") or wrote into it. So every test runs in a stage: a
folder that links each entry of the checkout (configs/, tests/, torchlaunch/, ...: relative paths mean
what they meant) except USER_OUTPUTS, which are the stage's own, empty at the start of a session.

`guard` is the net under that: a test that still writes into the checkout's runs/ (a subprocess given
cwd=REPO on a recipe's default run dir) fails, naming what appeared or went.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

USER_OUTPUTS = frozenset({"runs", "site", "job.yaml"})
"""What the README's and the docs' commands write in the checkout: run dirs (every recipe's default
run_dir is runs/NAME), `make docs`'s site and `launch.k8s ... > job.yaml`'s manifest."""


def build(repo: Path, stage: Path) -> Path:
    """`stage` linking every entry of `repo` but USER_OUTPUTS (made here, so none is the user's)."""
    stage.mkdir(parents=True, exist_ok=True)
    for entry in repo.iterdir():
        if entry.name not in USER_OUTPUTS and not (stage / entry.name).exists():
            (stage / entry.name).symlink_to(entry)
    return stage


RESULTS_ENV = "FAULTS_RESULTS_DIR"
"""Where `make faults` asks the fault-injection tests to save their outcomes (runs/faults): a folder the
suite was told to write, so not counted as a test's trespass."""


def runs_listing(repo: Path, env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The names under the checkout's runs/, but RESULTS_ENV's folder: one listing, cheap enough to take
    around every test. New or removed run dirs are what a test's launch leaves; changes inside a user's
    run dir are not compared (a run of the user's may train while the suite runs)."""
    runs = repo / "runs"
    asked = (env if env is not None else os.environ).get(RESULTS_ENV)
    told = {Path(asked).name} if asked and (repo / asked).resolve().parent == runs.resolve() else set()
    try:
        return frozenset({p.name for p in runs.iterdir()} - told)
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()


def guard(before: frozenset[str], after: frozenset[str]) -> str | None:
    """What a test did to the checkout's runs/, in one line, or None when nothing."""
    made, gone = sorted(after - before), sorted(before - after)
    if not made and not gone:
        return None
    said = [
        f"made {', '.join('runs/' + n for n in made)}" if made else "",
        f"removed {', '.join('runs/' + n for n in gone)}" if gone else "",
    ]
    return (
        f"the test {' and '.join(filter(None, said))} in the checkout's runs/, which is the user's: pass "
        "run_dir=tmp_path (or run from the stage: tests/workdir.py)"
    )
