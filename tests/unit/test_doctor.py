"""train.doctor: the pure checks over hand-made facts, and the real CLI on this CPU machine."""

from __future__ import annotations

import copy
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch.tools import doctor, machine_checks


def cpu_machine() -> dict:
    """Facts of a healthy CPU-only machine with a CUDA build of torch (like this one)."""
    return {
        "python": {"version": "3.11.7", "executable": "/usr/bin/python3"},
        "platform": {"system": "Linux", "machine": "x86_64", "hostname": "h", "cpu_count": 2},
        "env": {
            "CUDA_VISIBLE_DEVICES": None,
            "NVIDIA_VISIBLE_DEVICES": None,
            "OMP_NUM_THREADS": None,
        },
        "nvidia_smi": {"present": False, "gpus": [], "driver_version": None, "error": None},
        "torch": {
            "importable": True,
            "version": "2.14.1+cu130",
            "cuda_build": "13.0",
            "cudnn_version": 92400,
        },
        "cuda": {"available": False, "device_count": 0, "error": None},
        "distributed": {"available": True, "gloo": True, "nccl": True, "nccl_version": "2.30.7"},
        "devices": [
            {
                "device": "cpu",
                "name": "cpu",
                "memory_bytes": 2**34,
                "capability": None,
                "bf16": True,
                "fp16": True,
                "smoke": {"ok": True, "seconds": 0.01, "error": None},
            }
        ],
    }


def gpu_machine(visible: int = 2, driver_gpus: int = 2) -> dict:
    facts = cpu_machine()
    facts["nvidia_smi"] = {
        "present": True,
        "driver_version": "580.65",
        "gpus": [{"name": "NVIDIA H100", "memory_mib": 81559}] * driver_gpus,
        "error": None,
    }
    facts["cuda"] = {"available": visible > 0, "device_count": visible, "error": None}
    for i in range(visible):
        facts["devices"].append(
            {
                "device": f"cuda:{i}",
                "name": "NVIDIA H100",
                "memory_bytes": 80 * 2**30,
                "capability": "9.0",
                "bf16": True,
                "fp16": True,
                "smoke": {"ok": True, "seconds": 0.2, "error": None},
            }
        )
    return facts


def failures(facts: dict) -> list[machine_checks.Finding]:
    return [f for f in machine_checks.check_facts(facts) if f.level == machine_checks.FAIL]


def test_healthy_cpu_machine_passes() -> None:
    findings = machine_checks.check_facts(cpu_machine())
    assert [f for f in findings if f.level != machine_checks.OK] == []
    assert machine_checks.exit_code(findings) == 0
    assert any("CPU training on gloo" in f.message for f in findings)


def test_healthy_gpu_machine_passes() -> None:
    findings = machine_checks.check_facts(gpu_machine())
    assert machine_checks.exit_code(findings) == 0
    assert any("2 of 2 GPU(s) visible" in f.message for f in findings)


def test_cpu_only_torch_on_gpu_machine_names_the_fix() -> None:
    facts = gpu_machine(visible=0)
    facts["torch"]["cuda_build"] = None
    facts["torch"]["version"] = "2.14.1+cpu"
    [fail] = failures(facts)
    assert fail.check == "torch-build"
    assert "CPU-only build" in fail.message and "2 GPU(s)" in fail.message
    assert "CUDA build of torch" in fail.fix
    assert machine_checks.exit_code(machine_checks.check_facts(facts)) == 2


@pytest.mark.parametrize("value", ["", "-1", "none", "7"])
def test_cuda_visible_devices_hiding_every_gpu(value: str) -> None:
    facts = gpu_machine(visible=0)
    facts["env"]["CUDA_VISIBLE_DEVICES"] = value
    [fail] = failures(facts)
    assert fail.check == "visibility"
    assert f"CUDA_VISIBLE_DEVICES={value!r} hides all 2 GPU(s)" in fail.message
    assert "unset CUDA_VISIBLE_DEVICES" in fail.fix and "0,1" in fail.fix


def test_valid_visible_devices_but_no_cuda_points_at_the_driver() -> None:
    facts = gpu_machine(visible=0)
    facts["env"]["CUDA_VISIBLE_DEVICES"] = "0"
    [fail] = failures(facts)
    assert fail.check == "cuda"
    assert "driver 580.65" in fail.message and "upgrade the driver" in fail.fix


def test_broken_nvidia_smi_is_a_driver_failure() -> None:
    facts = gpu_machine(visible=0)
    facts["nvidia_smi"] = {
        "present": True,
        "gpus": [],
        "driver_version": None,
        "error": "NVIDIA-SMI has failed because it couldn't communicate",
    }
    [fail] = failures(facts)
    assert fail.check == "driver" and "couldn't communicate" in fail.message


def test_missing_nccl_with_gpus_fails_but_not_on_cpu() -> None:
    facts = gpu_machine()
    facts["distributed"]["nccl"] = False
    assert [f.check for f in failures(facts)] == ["nccl"]
    cpu = cpu_machine()
    cpu["distributed"]["nccl"] = False
    assert failures(cpu) == []


def test_missing_gloo_fails() -> None:
    facts = cpu_machine()
    facts["distributed"]["gloo"] = False
    assert [f.check for f in failures(facts)] == ["gloo"]


def test_missing_cudnn_on_gpu_fails() -> None:
    facts = gpu_machine()
    facts["torch"]["cudnn_version"] = None
    assert [f.check for f in failures(facts)] == ["cudnn"]


def test_failed_smoke_test_names_the_device() -> None:
    facts = gpu_machine()
    facts["devices"][2]["smoke"] = {
        "ok": False,
        "seconds": 0.1,
        "error": "RuntimeError: CUDA error: out of memory",
    }
    [fail] = failures(facts)
    assert fail.check == "cuda:1" and "out of memory" in fail.message


def test_gpu_without_bf16_warns_with_fp16_advice() -> None:
    facts = gpu_machine(visible=1, driver_gpus=1)
    facts["devices"][1].update(bf16=False, name="Tesla V100")
    findings = machine_checks.check_facts(facts)
    [warn] = [f for f in findings if f.level == machine_checks.WARN]
    assert "no bf16" in warn.message and "train.precision=fp16" in warn.fix
    assert machine_checks.exit_code(findings) == 0


def test_old_python_and_unimportable_torch() -> None:
    facts = cpu_machine()
    facts["python"]["version"] = "3.8.10"
    facts["torch"] = {"importable": False, "error": "ImportError: libcudart.so.13"}
    assert [f.check for f in failures(facts)] == ["python", "torch"]


def test_checks_do_not_mutate_facts() -> None:
    facts = gpu_machine()
    before = copy.deepcopy(facts)
    machine_checks.check_facts(facts)
    assert facts == before


def test_table_lists_devices_and_fixes() -> None:
    facts = gpu_machine(visible=0)
    facts["env"]["CUDA_VISIBLE_DEVICES"] = ""
    table = doctor.render_table(facts, machine_checks.check_facts(facts))
    assert "cuDNN                 9.24.0" in table
    assert "fix: unset CUDA_VISIBLE_DEVICES" in table
    assert table.endswith("doctor: FAILED")


def test_format_cudnn() -> None:
    assert doctor.format_cudnn(92400) == "9.24.0"
    assert doctor.format_cudnn(8907) == "8.9.7"
    assert doctor.format_cudnn(None) == "none"


def _run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    full_env = {**os.environ, "PYTHONPATH": pythonpath, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "torchlaunch.tools.doctor", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _fake_nvidia_smi(tmp_path: Path) -> Path:
    """This machine has no GPU, so a script stands in for nvidia-smi reporting two (a mock)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.65.06, 81559'\necho 'NVIDIA H100 80GB HBM3, 580.65.06, 81559'\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir
