"""The one launcher front (torchlaunch.launch.cli): the same grammar, program rule, pre-spawn policy and
error line on launch.local, launch.slurm and launch.k8s, in a run, --dry-run and --doctor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from torchlaunch.agent import node
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.backends.slurm import launch as slurm
from torchlaunch.exit_codes import BAD_INPUT, OK
from torchlaunch.launch import cli

SMOKE = "configs/smoke.yaml"
MODES = {"run": [], "dry-run": ["--dry-run"], "doctor": ["--doctor"]}


def cpu_args(launcher: str, tmp_path: Path) -> list[str]:
    """CPU workers on each launcher, a recipe that trains fp16."""
    recipe = ["--config", SMOKE, "train.precision=fp16"]
    if launcher == "local":
        return ["--gpus", "2", "--device", "cpu", *recipe, f"run_dir={tmp_path / 'run'}"]
    if launcher == "slurm":
        return ["--nodes", "1", "--tasks-per-node", "2", *recipe, f"run_dir={tmp_path / 'run'}"]
    return ["--nodes", "2", "--cpu-only", *recipe]


def never(*_: object, **__: object) -> None:
    raise AssertionError("the launcher went past its pre-spawn checks")


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may be submitted or started: the policy must stop the launcher before that."""
    monkeypatch.setattr(slurm, "submit", never)
    monkeypatch.setattr(slurm, "check_slurm_conf", never)
    monkeypatch.setattr(node, "run", never)


MAINS: dict[str, Callable[[list[str]], int]] = {"local": node.main, "slurm": slurm.main, "k8s": k8s.main}


IN_PROCESS = [(launcher, mode) for launcher in MAINS for mode in MODES if (launcher, mode) != ("local", "run")]
"""Every launcher x mode in this process; local's real run is its own subprocess test below."""


def test_fp16_on_gpus_passes_the_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal is about CPU workers: the same recipe on GPU tasks renders."""
    args = ["--nodes", "1", "--gpus-per-node", "2", "--config", SMOKE, "train.precision=fp16"]
    assert slurm.main(["--dry-run", *args, f"run_dir={tmp_path}"]) == OK
    assert k8s.main(["--nodes", "2", "--config", SMOKE, "train.precision=fp16"]) == OK
    assert "#SBATCH" in capsys.readouterr().out


@pytest.mark.parametrize("launcher", list(MAINS))
def test_a_launchers_own_refusal_has_one_prefix(launcher: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = MAINS[launcher](["--config", SMOKE, "--dry-run", "not-an-override"])
    err = capsys.readouterr().err
    assert code == BAD_INPUT
    assert err.splitlines() == ["launch error: override 'not-an-override' is not key=value (e.g. optim.lr=0.1)"]


@pytest.mark.parametrize("launcher", list(MAINS))
def test_a_program_with_a_recipe_is_refused_alike(launcher: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--run-dir", "/shared/x"] if launcher != "local" else []
    code = MAINS[launcher](["--dry-run", *extra, "--config", SMOKE, "--", "examples/custom_loop.py"])
    err = capsys.readouterr().err
    assert code == BAD_INPUT and len(err.splitlines()) == 1
    assert err.startswith("launch error: --config applies to the built-in worker, not to ")


def test_one_line_keeps_a_domain_line_and_prefixes_the_rest() -> None:
    assert cli.one_line(ValueError("config error: x\nmore")) == "config error: x"
    assert cli.one_line(ValueError("--nodes must be >= 1")) == "launch error: --nodes must be >= 1"
    assert cli.split_program(["--gpus", "2", "--", "a.py", "--", "b"]) == (["--gpus", "2"], ["a.py", "--", "b"])


def test_a_program_argument_cannot_add_a_line_to_the_sbatch_script() -> None:
    from torchlaunch.launch.spec import JobSpec

    spec = JobSpec(program=("/code/train.py", "x\ntouch /tmp/owned #"), run_dir="/shared/r")
    script = slurm.sbatch_script(spec, slurm.SlurmOptions(use_gpus=False, repo_root="/opt/repo", cwd="/code"))
    assert not any(line.startswith("touch") for line in script.splitlines())
    assert "# program in every task (torchlaunch.runner): /code/train.py 'x\\ntouch /tmp/owned #'" in script


def test_an_argument_cannot_add_a_line_to_the_manifests_header(capsys: pytest.CaptureFixture[str]) -> None:
    assert k8s.main(["--cpu-only", "--", "train.py", "x\nkind: Pod"]) == OK
    out = capsys.readouterr().out
    header = out.split("---", 1)[0]
    assert all(line.startswith("#") for line in header.splitlines()) and "'x\\nkind: Pod'" in header
