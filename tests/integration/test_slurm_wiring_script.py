"""test_slurm_wiring_script: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_slurm_wiring.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.test_emit import run_script
from tests.unit.test_slurm_wiring import (
    HOSTILE,
    call,
    submit_dir,  # noqa: F401 (fixtures, used by name)
)
from torchlaunch.backends.slurm import cluster as slurm_cluster
from torchlaunch.exit_codes import OK


def test_a_hostile_argument_runs_nothing_in_the_sbatch_script(submit_dir: Path, tmp_path: Path) -> None:
    code, script, err = call(["--dry-run", "--run-dir", str(tmp_path / "run"), "--", "script.py", HOSTILE])
    assert code == OK, err
    result, work = run_script(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (submit_dir / "F").exists() and not (work / "F").exists() and not (tmp_path / "F").exists()
    assert "x\\ntouch F #" in script


SLURM_TOOLS = ("squeue", "sacct", "scontrol", "sinfo", "sbatch", "scancel")


def tools_on_path(folder: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Every Slurm tool on a PATH of its own, each one running `script` (a shell body)."""
    folder.mkdir()
    for tool in SLURM_TOOLS:
        (folder / tool).write_text(f"#!/bin/sh\n{script}\n")
        (folder / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))


def test_a_slurm_tool_that_gives_no_answer_is_cannot_say_never_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one error rule of backends.slurm.cluster: a tool that is missing, fails or answers past its
    timeout is "cannot say" for every question (UNKNOWN, None), never a job that ended."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    assert slurm_cluster.run([sleep, "10"], timeout_s=0.2) is None  # bounded: no answer in time

    def cannot_say() -> None:
        for ask in (slurm_cluster.controller_state, slurm_cluster.job_state, slurm_cluster.scontrol_state):
            assert ask("7") == "UNKNOWN"
        assert slurm_cluster.state("7") is None and slurm_cluster.owner_fields("7") is None
        assert slurm_cluster.cluster_partitions() is None and slurm_cluster.default_partition() is None
        assert slurm_cluster.node_cpus("p") is None and slurm_cluster.partition_grace_s("p") is None
        assert not slurm_cluster.scancel("7") and not slurm_cluster.set_comment("7", "c")
        with pytest.raises(RuntimeError):
            slurm_cluster.sbatch(["sbatch", "--parsable", "x.sh"], {})

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no Slurm tools on this machine
    cannot_say()
    assert slurm_cluster.requeue("7") is None
    tools_on_path(tmp_path / "failing", monkeypatch, "echo RUNNING; echo 'slurm_load_jobs error' >&2; exit 1")
    cannot_say()  # a failed query's output is no answer either
    assert slurm_cluster.requeue("7") == slurm_cluster.Answer(1, "RUNNING\n", "slurm_load_jobs error\n")
    tools_on_path(tmp_path / "answering", monkeypatch, "echo RUNNING")
    assert slurm_cluster.controller_state("7") == "RUNNING" and slurm_cluster.state("7") == "RUNNING"
