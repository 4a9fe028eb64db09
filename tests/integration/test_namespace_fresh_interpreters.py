"""The project owns one import name: a user's own `train`, `launch`, `utils` or `models` never collides
with ours (docs/ARCHITECTURE rule 1).

Static: no module under torchlaunch/ imports a top-level `train` or `launch`. Fresh interpreters: the
runner leaves only `torchlaunch*` of ours in sys.modules. Real engines: two user projects
(tests/programs/userproj_script: nanoGPT's layout, `train.py` beside `models.py` and `utils.py`;
tests/programs/userproj_pkg: a `train/` package run as `-m train.main`) copied to a temporary folder
and launched from it on 2 CPU ranks by launch.local (module and console script) and on the Slurm dev
cluster; tests/engines/test_docker_user_program.py runs them as Kubernetes pods in containers. Each rank
records what was in sys.modules at the project's first statement, and trains a few DDP steps.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv, run_cmd

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
PACKAGE = REPO / "torchlaunch"
OURS = ("train", "launch", "utils", "models")
"""Names a user project is likely to use for itself: nothing of ours may be imported under them."""
PROJECTS = {
    "script": (["train.py"], "train.py"),
    "pkg": (["-m", "train.main"], "train/main.py"),
}
"""Each user project: the program after `--`, and the file that runs as __main__ (relative to it)."""


# ------------------------------------------------------------------------------------------- static


def top_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module name) of every absolute import in the file, and of the constant first
    argument of importlib.import_module / runpy.run_module / __import__ calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "run_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


# ----------------------------------------------------------------------------------- fresh interpreters


def ours_in(modules: dict[str, str | None], roots: tuple[str, ...]) -> dict[str, str]:
    """The modules (name -> file) loaded from one of our source trees (an installed package is not ours,
    even when the virtual environment lives inside the checkout, as `make install` puts it)."""
    return {name: file for name, file in modules.items() if file and _inside_a_root(file, roots)}


def _inside_a_root(file: str, roots: tuple[str, ...]) -> bool:
    for root in roots:
        if file.startswith(root):
            return f"site-packages{os.sep}" not in file[len(root) :]
    return False


def assert_only_torchlaunch_of_ours(modules: dict[str, str | None], roots: tuple[str, ...]) -> None:
    ours = ours_in(modules, roots)
    assert "torchlaunch" in ours, f"torchlaunch was not loaded from {roots}: {modules.get('torchlaunch')}"
    foreign = {n: f for n, f in ours.items() if n != "torchlaunch" and not n.startswith("torchlaunch.")}
    assert foreign == {}, f"modules of ours under other names: {foreign}"
    taken = sorted(n for n in modules if n.split(".")[0] in OURS)
    assert taken == [], f"names a user project could own are taken: {taken}"


DUMP = "import json, sys; print(json.dumps({n: getattr(m, '__file__', None) for n, m in list(sys.modules.items())}))"


def test_runner_imported_in_a_fresh_interpreter_loads_only_torchlaunch(tmp_path: Path) -> None:
    rc, out, err = run_cmd([sys.executable, "-c", f"import torchlaunch.runner; {DUMP}"], timeout=60, cwd=tmp_path)
    assert rc == 0, err
    assert_only_torchlaunch_of_ours(json.loads(out), (str(REPO) + os.sep,))


def test_python_m_runner_hands_a_script_only_torchlaunch(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(DUMP + "\nprint(__file__)\nprint(sys.argv[0])\n")
    rc, out, err = run_cmd([sys.executable, "-m", "torchlaunch.runner", "probe.py"], timeout=60, cwd=tmp_path)
    assert rc == 0, err
    dump, file, argv0 = out.splitlines()
    modules = json.loads(dump)
    assert_only_torchlaunch_of_ours(modules, (str(REPO) + os.sep,))
    assert file == str(script) and argv0 == "probe.py"  # as `python probe.py` sets them
    assert "torch" not in modules  # the runner stays torch-free: the program decides what to import


# -------------------------------------------------------------------------------------- real engines


def user_project(kind: str, parent: Path) -> Path:
    """A copy of the user project outside the repository (the user's own folder)."""
    target = parent / f"userproj_{kind}"
    shutil.copytree(PROGRAMS / f"userproj_{kind}", target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def assert_user_world(seen: list[dict], kind: str, project: str, roots: tuple[str, ...], world_size: int = 2) -> None:
    """What every rank of a user project recorded: its own modules, nothing of ours under a user's name,
    an absolute __file__, and DDP training on gloo that moved every rank to the same weights."""
    assert len(seen) == world_size, f"{len(seen)} of {world_size} ranks recorded"
    main_file = os.path.join(project, PROJECTS[kind][1])
    for rank in seen:
        at_start: dict[str, str | None] = rank["at_start"]
        assert rank["file"] == main_file and os.path.isabs(rank["file"])
        assert rank["cwd"] == project and rank["utils_file"] == os.path.join(project, "utils.py")
        if kind == "script":
            assert rank["train_file"] == main_file and rank["models_file"] == os.path.join(project, "models.py")
            assert rank["path0"] == project
        else:
            assert rank["train_file"] == os.path.join(project, "train", "__init__.py")
            assert rank["helpers_file"] == os.path.join(project, "train", "helpers.py")
            assert rank["name"] == "__main__" and rank["path0"] == project
            # the package being imported is the only user name present, and it is the user's; runpy
            # imports it before it makes train.main the __main__ module, so __main__ is still the runner
            assert at_start.get("train") == rank["train_file"] and rank["main_module_file"] == main_file
            at_start = {n: f for n, f in at_start.items() if n not in ("train", "__main__")}
        assert_only_torchlaunch_of_ours(at_start, roots)
        assert rank["world_size"] == world_size and rank["backend"] == "gloo"
        before, after = rank["full_loss_before_after"]
        assert after < before, rank["full_loss_before_after"]
    assert len({rank["checksum"] for rank in seen}) == 1  # DDP kept the replicas equal


def local_argv(how: str) -> list[str]:
    if how == "command":  # what users type: the thin top-level command module
        return launcher_argv("launch.local")
    if how == "module":
        return launcher_argv("torchlaunch.agent")
    script = Path(sys.executable).parent / "torchlaunch-local"
    if not script.is_file():
        pytest.skip(f"no console script next to {sys.executable} (pip install -e . installs it)")
    return [str(script)]


CI_PAIRS = {("pkg", "module"), ("script", "command"), ("script", "console-script")}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "kind, how",
    [
        # CI's tier: each kind of project and each way of starting the launcher at least once
        pytest.param(kind, how, id=f"{kind}-{how}", marks=[] if (kind, how) in CI_PAIRS else [pytest.mark.extended])
        for kind in sorted(PROJECTS)
        for how in ("command", "module", "console-script")
    ],
)
def test_user_project_from_its_own_folder_under_launch_local(kind: str, how: str, tmp_path: Path) -> None:
    project, out = user_project(kind, tmp_path), tmp_path / "out"
    argv = [*local_argv(how), "--gpus", "2", "--device", "cpu", "--", *PROJECTS[kind][0], "--out", str(out)]
    rc, stdout, err = run_cmd(argv, timeout=150, cwd=project)  # PYTHONPATH: this checkout's torchlaunch
    assert rc == 0, err[-3000:]
    assert_user_world(records(out), kind, str(project), (str(REPO) + os.sep,))
