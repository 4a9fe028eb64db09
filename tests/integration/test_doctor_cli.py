"""test_doctor_cli: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_doctor.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.unit.test_doctor import _fake_nvidia_smi, _run_cli


def test_cli_on_this_machine_passes() -> None:
    result = _run_cli()  # bounded by _run_cli's timeout; how long it takes is not a test's business
    assert result.returncode == 0, result.stdout + result.stderr
    for field in ("python", "torch", "CUDA runtime", "CUDA driver", "cuDNN", "NCCL", "gloo"):
        assert field in result.stdout
    assert "cpu " in result.stdout and "doctor: OK" in result.stdout


def test_cli_json_parses_with_expected_fields() -> None:
    result = _run_cli("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["exit_code"] == 0
    facts = report["facts"]
    assert facts["torch"]["version"].startswith("2.")
    assert facts["distributed"]["gloo"] is True
    cpu = facts["devices"][0]
    assert cpu["device"] == "cpu" and cpu["smoke"]["ok"] is True and cpu["memory_bytes"] > 0
    assert {f["level"] for f in report["findings"]} <= {"ok", "warn"}


def test_cli_fails_when_gpus_exist_but_are_hidden(tmp_path: Path) -> None:
    bin_dir = _fake_nvidia_smi(tmp_path)
    result = _run_cli(env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert "CUDA_VISIBLE_DEVICES='' hides all 2 GPU(s)" in result.stdout
    assert "fix: unset CUDA_VISIBLE_DEVICES" in result.stdout
