"""Every backend's `render` (the dry run) is the launcher's own pure function, reached through the
Scheduler interface: the same text for the same input, nothing written, no process started.

"No process" is checked by making subprocess.Popen and os.fork fail for the call; "nothing written" by
rendering for a run dir inside an empty folder that must stay empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchlaunch import backends
from torchlaunch.agent import commands
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.k8s import options as k8s_opts
from torchlaunch.backends.slurm import launch as slurm
from torchlaunch.launch.spec import JobSpec


def no_process(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("render started a process")


def render_purely(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, spec: JobSpec, options: Any
) -> tuple[str, str]:
    backend = backends.get(name)
    assert backend is not None
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", no_process)
        m.setattr(os, "fork", no_process)
        first, second = backend.render(spec, options), backend.render(spec, options)
    assert list(tmp_path.iterdir()) == [], "render wrote files"
    return first, second


def specs(tmp_path: Path) -> dict[str, tuple[JobSpec, Any, Callable[[], str]]]:
    run_dir = str(tmp_path / "run")
    program = JobSpec(program=("train.py", "--lr", "0.1"), run_dir=run_dir, nodes=2, gpus_per_node=4)
    builtin = JobSpec(config="configs/smoke.yaml", run_dir=run_dir, nodes=2, gpus_per_node=4)
    placement = commands.NodePlacement(node_rank=1, master_addr="node0")
    slurm_options = slurm.SlurmOptions(python="/opt/venv/bin/python", repo_root="/opt/repo", cwd="/code")
    k8s_options = (k8s_opts.K8sOptions(name="run"), "seed: 0\n")
    in_pod = program.replace(run_dir="/shared/runs/a")  # a pod's run dir is on the shared volume
    return {
        "local": (builtin, placement, lambda: " ".join(commands.render(builtin, placement))),
        "slurm": (program, slurm_options, lambda: slurm.sbatch_script(program, slurm_options)),
        "k8s": (in_pod, k8s_options, lambda: k8s.to_yaml(k8s_manifest.manifests(in_pod, *k8s_options))),
    }


def test_importing_the_schedulers_loads_no_launcher_and_no_torch() -> None:
    """render/submit load their launcher by name on first use: the operator commands stay light."""
    code = (
        "import sys, torchlaunch.backends as s; "
        "bad = [m for m in sys.modules if m.startswith('torchlaunch.launch') or m.split('.')[0] == 'torch']; "
        "print(bad); assert not bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
