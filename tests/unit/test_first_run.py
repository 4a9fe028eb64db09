"""What a new user's first commands met (issue 51, items 1, 3, 4, 5, 8 and part of 10), one test per
cause: the suite read the runs/ the quick start leaves, README examples shared a run dir with other
configs, and the commands' own words outside .venv. In-process; their subprocess halves are in
tests/integration/test_first_run_commands.py."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import workdir
from tests.conftest import REPO, stage
from torchlaunch import config as config_mod
from torchlaunch import rundir
from torchlaunch.agent import node
from torchlaunch.exit_codes import BAD_INPUT, OK
from torchlaunch.jobs import record
from torchlaunch.launch import deps, finished
from torchlaunch.worker import slow_start


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
    code = node.main(["--device", "cpu", "--config", "configs/smoke.yaml", "seed=7", "--dry-run"])
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


def test_every_dependency_of_the_project_is_known_to_the_commands() -> None:
    """deps.PACKAGES is pyproject.toml's `dependencies`: a package added there is checked too."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]}
    assert declared == set(deps.PACKAGES.values())


def test_a_python_without_the_packages_gets_one_line_naming_the_venv(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert deps.missing(["torch", "yaml"], find=lambda name: None) == ["torch", "pyyaml"]
    monkeypatch.setattr(deps, "missing", lambda names: ["torch"])
    with pytest.raises(SystemExit) as ended:
        deps.run_module("torchlaunch.agent", "launch.local", deps.TRAINING)
    lines = capsys.readouterr().err.splitlines()
    assert ended.value.code == BAD_INPUT and len(lines) == 1
    assert lines[0].startswith("env error:") and ".venv/bin/python -m launch.local" in lines[0]


def test_a_dependency_missing_inside_a_command_is_the_same_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def lacking(module: str, **_: object) -> None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(deps.runpy, "run_module", lambda module, **kw: lacking("numpy.linalg"))
    with pytest.raises(SystemExit) as ended:
        deps.run_module("torchlaunch.jobs.cli", "launch")
    assert ended.value.code == BAD_INPUT and "lacks numpy" in capsys.readouterr().err
    monkeypatch.setattr(deps.runpy, "run_module", lambda module, **kw: lacking("my_plugin"))
    with pytest.raises(ModuleNotFoundError):  # not the project's: the command's own error stands
        deps.run_module("torchlaunch.jobs.cli", "launch")


def finished_run(run_dir: Path) -> Path:
    """A run dir as a finished smoke run leaves it (config, the last launch's record, model.pt)."""
    cfg = config_mod.load("configs/smoke.yaml", [f"run_dir={run_dir}"])
    config_mod.settle_resolved(cfg, reconfigure=False)
    rec = record.start(run_dir, scheduler="local", command=["launch.local"])
    record.finish(run_dir, rec, OK, "finished")
    rundir.model(run_dir).write_bytes(b"weights")
    return record.record_path(run_dir)


def test_a_finished_runs_rerun_exits_0_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10-14 s of torchrun, ranks and data before: now the launcher reads the run dir and starts nothing
    (a unit test fails on any process started) and writes nothing (the record is the finish's)."""
    run = tmp_path / "run"
    job = finished_run(run)
    kept = job.read_bytes()
    assert node.main(["--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml", f"run_dir={run}"]) == OK
    assert "finished already: nothing to train (exit 0)" in capsys.readouterr().err
    assert job.read_bytes() == kept


def test_a_reconfigured_or_unfinished_run_is_left_to_its_ranks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    finished_run(run)
    assert finished.finished(run)
    assert not finished.already(run, changed=True, one_node=True)
    assert not finished.already(run, changed=False, one_node=False)
    later = rundir.model(run).stat().st_mtime + 5
    os.utime(rundir.config(run), (later, later))  # a --reconfigure wrote config.yaml after the model
    assert not finished.finished(run)
    rec = record.start(tmp_path / "other", scheduler="local", command=["launch.local"])
    record.finish(tmp_path / "other", rec, 75, "preempted")
    assert not finished.finished(tmp_path / "other")


LAUNCHES = re.compile(r"^(make train-local|python -m (launch\.local|launch\.slurm|train))( |$)")


def trained_run(cmd: str) -> tuple[str, tuple[str, ...]] | None:
    """(run dir, what its config is made of) of a documented command that trains the built-in worker
    (None for anything else: a program after --, a dry run, a pre-flight, another command)."""
    match = LAUNCHES.match(cmd)
    if match is None or " -- " in cmd or "--dry-run" in cmd or "--doctor" in cmd or " ... " in cmd:  # elided
        return None
    words = shlex.split(cmd.split("&&")[0])
    if words[0] == "make":
        settings = dict(w.split("=", 1) for w in words[2:] if "=" in w)
        config, overrides = settings.get("CONFIG", "configs/cifar10.yaml"), settings.get("ARGS", "").split()
    else:
        config = words[words.index("--config") + 1] if "--config" in words else "configs/cifar10.yaml"
        overrides = [w for w in words if "=" in w and not w.startswith("-")]
    given = dict(o.split("=", 1) for o in overrides)
    run_dir = given.pop("run_dir", None) or config_mod.load(str(REPO / config), []).run_dir
    launcher = "launch.local" if words[0] == "make" else words[2]  # make train-local runs launch.local
    return run_dir, (launcher, config, *sorted(f"{k}={v}" for k, v in given.items()))


def test_documented_examples_never_share_a_run_dir_with_another_config() -> None:
    """README task 1 then task 3 met on one default run dir with other configs: "was started with
    another config"; so did the quick start and live.md's first command. The same command twice (a
    rerun) may share one. Every page a user copies commands from: the README and each docs page."""
    from tests.unit.test_readme_commands import all_commands

    seen: dict[str, tuple[str, tuple[str, ...]]] = {}
    clashes = []
    for page, cmd in all_commands([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]):
        found = trained_run(cmd)
        if found is None:
            continue
        run_dir, made_of = found
        first = seen.setdefault(run_dir, (f"{page}: {cmd}", made_of))
        if first[1] != made_of:
            clashes.append(f"{run_dir}: {first[0]} / {page}: {cmd}")
    assert not clashes, "\n".join(clashes)


class FakeTimer:
    """threading.Timer's part Phases uses; `fire()` is the delay having passed."""

    def __init__(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.delay_s, self.fn, self.cancelled = delay_s, fn, False
        TIMERS.append(self)

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.fn()


TIMERS: list[FakeTimer] = []


def test_a_long_start_up_says_what_it_is_doing() -> None:
    """2.5 minutes of silence while the cache was decoded: a phase past its few seconds says so, once,
    from rank 0; a quick phase says nothing (a normal start's output is unchanged)."""
    said: list[str] = []
    TIMERS.clear()
    phases = slow_start.Phases(True, timer=FakeTimer, say=said.append)
    with phases("preparing the data (data.name=imagefolder)"):
        TIMERS[-1].fire()  # still preparing when its time passed
    with phases("building the model"):
        pass
    TIMERS[-1].fire()  # ended before: cancelled, silent
    assert said == [f"start-up: preparing the data (data.name=imagefolder) for {slow_start.AFTER_S:.0f} s ..."]
    quiet = slow_start.Phases(False, timer=FakeTimer, say=said.append)
    with quiet("preparing the data"):
        pass
    assert len(said) == 1 and len(TIMERS) == 2  # another rank: no timer at all


def test_every_command_a_user_types_starts_through_the_dependency_check() -> None:
    """launch/*.py and train/*.py are the commands of the README; each one outside .venv is one line."""
    commands = [p for folder in ("launch", "train") for p in sorted((REPO / folder).glob("*.py"))]
    unchecked = [
        str(p.relative_to(REPO))
        for p in commands
        if p.name not in ("__init__.py", "lighthouse.py") and "deps.run_module(" not in p.read_text(encoding="utf-8")
    ]
    assert not unchecked, unchecked


def test_the_readme_commands_copy_never_reinstalls_the_users_venv(tmp_path: Path) -> None:
    """A README command's `make install` in the test's copy re-pointed the shared .venv at the copy."""
    from tests.unit.test_readme_commands import installed_as_is

    venv, tree = tmp_path / "venv", tmp_path / "tree"
    venv.mkdir()
    tree.mkdir()
    (venv / ".installed").touch()
    (tree / "Makefile").write_text("$(VENV)/.installed: pyproject.toml setup.py\n\ttouch $@\n")
    for name in ("pyproject.toml", "setup.py"):
        (tree / name).touch()
        later = (venv / ".installed").stat().st_mtime + 60  # edited after the install
        os.utime(tree / name, (later, later))
    installed_as_is(tree, venv)
    done = (venv / ".installed").stat().st_mtime
    assert all((tree / n).stat().st_mtime < done for n in ("pyproject.toml", "setup.py"))
