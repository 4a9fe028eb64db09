"""test_launcher_front_refusals: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_launcher_front.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env
from tests.unit.test_launcher_front import (
    IN_PROCESS,
    MAINS,
    MODES,
    SMOKE,
    cpu_args,
    no_cluster,  # noqa: F401 (fixtures, used by name)
)
from torchlaunch.exit_codes import BAD_INPUT, OK
from torchlaunch.trainer_sections import fp16_on_cpu_message


@pytest.mark.parametrize(("launcher", "mode"), IN_PROCESS)
def test_fp16_on_cpu_is_refused_by_every_launcher_in_every_mode(
    launcher: str, mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_cluster: None
) -> None:
    code = MAINS[launcher]([*MODES[mode], *cpu_args(launcher, tmp_path)])
    out, err = capsys.readouterr()
    assert code == BAD_INPUT and out == ""
    assert err.splitlines() == [fp16_on_cpu_message()]
    assert not (tmp_path / "run").exists()


def test_local_run_refuses_fp16_on_cpu_before_torchrun(tmp_path: Path) -> None:
    """The real command: exit 2 with the same line, before the launch line, torchrun or even torch."""
    probe = (
        "import sys; from torchlaunch.agent import node; code = node.main(sys.argv[1:]); "
        "print('TORCH', 'torch' in sys.modules); sys.exit(code)"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, *cpu_args("local", tmp_path)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == BAD_INPUT
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [fp16_on_cpu_message()]
    assert r.stdout.strip() == "TORCH False"  # nothing was started: no torchrun, no worker
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("launcher", list(MAINS))
def test_overrides_mix_with_options(launcher: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--config X k=v --dry-run k2=v`: one grammar, overrides anywhere before `--`."""
    head = {
        "local": ["--device", "cpu", f"run_dir={tmp_path}"],  # never the user's runs/smoke
        "slurm": ["--tasks-per-node", "1", f"run_dir={tmp_path}"],
        "k8s": ["--cpu-only"],
    }[launcher]
    code = MAINS[launcher](["--config", SMOKE, "seed=7", "--dry-run", *head, "optim.lr=0.05"])
    out, err = capsys.readouterr()
    assert code == OK, err
    if launcher == "k8s":  # the overrides reach the pods' command
        assert "seed=7" in out and "optim.lr=0.05" in out
    elif launcher == "local":
        assert "torchlaunch.runner -m torchlaunch.worker" in out


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (["launch.local", "--gpus", "x", "--", "x.py"], "launch error: argument --gpus: invalid int value: 'x'"),
        (["launch.slurm", "--bogus", "--dry-run"], "launch error: unrecognized arguments: --bogus"),
        (["launch.k8s", "--nodes"], "launch error: argument --nodes: expected one argument"),
        (["launch.local", "--console-ranks", "0\n1", "--", "x.py"], "launch error: argument --console-ranks:"),
        (["launch", "status", "--bogus"], "launch error: the following arguments are required: run_dir"),
        (["train", "--bogus"], "unrecognized arguments: --bogus (see python -m train --help)"),
        (["train.evaluate"], "one of the arguments --run-dir --checkpoint is required"),
    ],
)
def test_argparses_own_refusals_are_one_line_and_exit_2(command: list[str], words: str) -> None:
    """What argparse itself refuses (a bad type, an unknown option, a missing value) reads like the
    commands' own refusals: one line naming --help, exit 2, never usage text plus a second line."""
    done = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(words), done.stderr
    assert "--help" in lines[0] and "usage:" not in done.stderr


def test_a_lighthouse_nobody_serves_is_refused_at_launch_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 52: recovery.lighthouse pointing nowhere passed the launch and failed in every rank with a
    traceback after ~19 s. The launcher looks once (bounded, loopback: a refused connection) and says
    it in one line, exit 2, before anything is written."""
    import time

    from tests.conftest import free_port_pair
    from torchlaunch.agent import node

    port = free_port_pair()
    run_dir = tmp_path / "run"
    start = time.monotonic()
    argv = ["--nnodes", "1:2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--device", "cpu"]
    overrides = ["recovery.live=true", f"recovery.lighthouse=http://127.0.0.1:{port}", f"run_dir={run_dir}"]
    code = node.main([*argv, "--config", SMOKE, *overrides])
    err = capsys.readouterr().err.splitlines()
    assert code == BAD_INPUT and len(err) == 1, err
    assert f"its Lighthouse at 127.0.0.1:{port} cannot be reached (Connection refused" in err[0]
    assert time.monotonic() - start < 10 and not run_dir.exists()


def test_a_lighthouse_not_up_yet_is_not_refused_inside_a_kubernetes_pod() -> None:
    """A pod may start before the service's pod is ready, and exit 2 there is final: no look there."""
    from tests.conftest import free_port_pair
    from torchlaunch import contract
    from torchlaunch.agent import lighthouse_reach
    from torchlaunch.exit_codes import BadInput

    nowhere = f"http://127.0.0.1:{free_port_pair()}"
    pod = {contract.K8S_JOB: "run", contract.KUBERNETES_SERVICE_HOST: "10.0.0.1"}
    lighthouse_reach.check(nowhere, env=pod)
    with pytest.raises(BadInput, match="cannot be reached"):
        lighthouse_reach.check(nowhere, env={})
