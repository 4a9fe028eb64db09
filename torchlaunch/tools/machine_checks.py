"""The doctor's verdicts: pure functions from a facts dict (torchlaunch.tools.machine_facts) to findings,
each with the fix when it is not ok, so a CPU-only torch on a GPU machine, a GPU hidden by
CUDA_VISIBLE_DEVICES or a driver older than the CUDA runtime is a unit test, not a failed run hours into
a queue. The pre-flight (torchlaunch.tools.preflight) reports in the same Finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlaunch import exit_codes

MIN_PYTHON = (3, 10)

OK = "ok"
WARN = "warn"
FAIL = "fail"


@dataclass(frozen=True)
class Finding:
    """One verdict: a level, what was checked, what was seen, and the fix when it is not ok."""

    level: str
    check: str
    message: str
    fix: str = ""


def _check_plugins(facts: dict[str, Any]) -> list[Finding]:
    findings = []
    for p in facts.get("plugins", []):
        if p["ok"]:
            findings.append(Finding(OK, p["key"], f"{p['name']} resolves to {p['file']}"))
        else:
            problem, _, fix = p["error"].removeprefix("config error: ").rpartition(" (")
            findings.append(Finding(FAIL, p["key"], problem or fix, fix.removesuffix(")") if problem else ""))
    return findings


def check_facts(facts: dict[str, Any]) -> list[Finding]:
    """Judge the facts; pure, so every failure case is a unit test with a hand-made dict."""
    findings = [_check_python(facts), *_check_plugins(facts)]
    torch_facts = facts.get("torch", {})
    if not torch_facts.get("importable", False):
        findings.append(
            Finding(
                FAIL,
                "torch",
                f"torch cannot be imported ({torch_facts.get('error')})",
                "install the project: pip install -c constraints.txt -e .",
            )
        )
        return findings
    findings.append(Finding(OK, "torch", f"torch {torch_facts['version']}"))
    findings.extend(_check_gpu_visibility(facts))
    findings.extend(_check_distributed(facts))
    findings.extend(_check_devices(facts))
    return findings


def _check_python(facts: dict[str, Any]) -> Finding:
    version = facts["python"]["version"]
    parts = tuple(int(p) for p in version.split(".")[:2])
    if parts < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Finding(FAIL, "python", f"Python {version} is too old", f"use Python >= {need}")
    return Finding(OK, "python", f"Python {version}")


def _check_gpu_visibility(facts: dict[str, Any]) -> list[Finding]:
    smi = facts.get("nvidia_smi", {})
    driver_gpus = len(smi.get("gpus", []))
    cuda = facts.get("cuda", {})
    visible = cuda.get("device_count", 0)
    cuda_build = facts["torch"].get("cuda_build")
    cvd = facts.get("env", {}).get("CUDA_VISIBLE_DEVICES")

    if smi.get("present") and smi.get("error"):
        return [
            Finding(
                FAIL,
                "driver",
                f"nvidia-smi is installed but fails: {smi['error']}",
                "the NVIDIA driver is not loaded or mismatched: reboot/reload the kernel "
                "module, or run on a node whose driver works",
            )
        ]
    if driver_gpus == 0:
        if cvd not in (None, ""):
            note = f" (CUDA_VISIBLE_DEVICES={cvd!r} is set but no GPU driver was found)"
        else:
            note = ""
        return [Finding(OK, "gpus", f"no NVIDIA GPU on this machine: CPU training on gloo{note}")]

    if cuda_build is None:
        return [
            Finding(
                FAIL,
                "torch-build",
                f"nvidia-smi shows {driver_gpus} GPU(s) but torch {facts['torch']['version']} is a CPU-only build",
                "reinstall a CUDA build of torch (pip install -c constraints.txt torch, from "
                "the CUDA wheel index), not the +cpu wheel",
            )
        ]
    if visible == 0 and cvd is not None and _hides_all(cvd, driver_gpus):
        return [
            Finding(
                FAIL,
                "visibility",
                f"CUDA_VISIBLE_DEVICES={cvd!r} hides all {driver_gpus} GPU(s) nvidia-smi shows",
                "unset CUDA_VISIBLE_DEVICES or list valid indices/UUIDs "
                f"(e.g. CUDA_VISIBLE_DEVICES={','.join(str(i) for i in range(driver_gpus))})",
            )
        ]
    if visible == 0:
        driver = smi.get("driver_version")
        detail = f": {cuda['error']}" if cuda.get("error") else ""
        return [
            Finding(
                FAIL,
                "cuda",
                f"nvidia-smi shows {driver_gpus} GPU(s) (driver {driver}) but torch (CUDA "
                f"{cuda_build}) cannot use them{detail}",
                f"the driver is probably older than CUDA {cuda_build} needs: upgrade the "
                "driver, or install a torch built for an older CUDA",
            )
        ]
    findings = [
        Finding(
            OK,
            "gpus",
            f"{visible} of {driver_gpus} GPU(s) visible to torch "
            f"(CUDA {cuda_build}, driver {smi.get('driver_version')})",
        )
    ]
    if visible < driver_gpus and cvd is None:
        findings.append(
            Finding(
                WARN,
                "visibility",
                f"torch sees {visible} GPU(s) but nvidia-smi shows {driver_gpus}",
                "check NVIDIA_VISIBLE_DEVICES / container GPU flags",
            )
        )
    if facts["torch"].get("cudnn_version") is None:
        findings.append(
            Finding(
                FAIL,
                "cudnn",
                "cuDNN is not available: convolutions will be slow or fail",
                "install the nvidia-cudnn wheel that matches torch (pip install -c constraints.txt -e .)",
            )
        )
    return findings


def _hides_all(cuda_visible_devices: str, driver_gpus: int) -> bool:
    """Whether this CUDA_VISIBLE_DEVICES leaves no GPU: CUDA stops at the first invalid entry."""
    first = cuda_visible_devices.split(",")[0].strip()
    if first.upper().startswith(("GPU-", "MIG-")):
        return False
    try:
        index = int(first)
    except ValueError:
        return True  # '', 'none', 'NoDevFiles', ...
    return not 0 <= index < driver_gpus


def _check_distributed(facts: dict[str, Any]) -> list[Finding]:
    dist = facts.get("distributed", {})
    if not dist.get("available"):
        return [
            Finding(
                FAIL,
                "distributed",
                "torch.distributed is not available in this build",
                "install the standard torch wheel (pip install -c constraints.txt -e .)",
            )
        ]
    findings = []
    if dist.get("gloo"):
        findings.append(Finding(OK, "gloo", "gloo backend available (CPU runs, object collectives)"))
    else:
        findings.append(
            Finding(
                FAIL,
                "gloo",
                "gloo backend missing: CPU training cannot start",
                "install the standard torch wheel",
            )
        )
    if facts.get("cuda", {}).get("device_count", 0) > 0:
        if dist.get("nccl"):
            findings.append(Finding(OK, "nccl", f"NCCL {dist.get('nccl_version')} available"))
        else:
            findings.append(
                Finding(
                    FAIL,
                    "nccl",
                    "GPUs are visible but NCCL is missing",
                    "install a CUDA torch wheel with NCCL (nvidia-nccl package)",
                )
            )
    return findings


def _check_devices(facts: dict[str, Any]) -> list[Finding]:
    findings = []
    for device in facts.get("devices", []):
        smoke = device.get("smoke")
        label = f"{device['device']}"
        if smoke is None:
            continue
        if not smoke["ok"]:
            findings.append(
                Finding(
                    FAIL,
                    label,
                    f"conv forward+backward failed: {smoke['error']}",
                    "this device cannot train: check the driver, the torch build "
                    "and that no other process holds all its memory",
                )
            )
            continue
        findings.append(Finding(OK, label, f"conv forward+backward in {smoke['seconds']:.3f}s"))
        if device["device"] == "cpu" and device.get("rates"):
            findings.append(_cpu_precision_finding(device["rates"]))
        if device["device"].startswith("cuda") and device.get("bf16") is False:
            findings.append(
                Finding(
                    WARN,
                    label,
                    f"{device['name']} has no bf16",
                    "use train.precision=fp16 (with the grad scaler) or fp32",
                )
            )
    return findings


def _cpu_precision_finding(rates: dict[str, Any]) -> Finding:
    """Which precisions are fast on this CPU: both measured rates, the faster named; fp16 is never."""
    if rates.get("error"):
        return Finding(
            WARN,
            "cpu precision",
            f"could not time {rates['model']}: {rates['error']}",
            "set train.precision=fp32 (always works) or bf16 explicitly",
        )
    fast = rates["auto_picks"]
    return Finding(
        OK,
        "cpu precision",
        f"{rates['model']} trains at bf16 {rates['bf16']:.0f} vs fp32 {rates['fp32']:.0f} images/s "
        f"(batch {rates['batch']}, one thread): {fast} is the fast one here; precision=auto "
        f"measures each run's own model and threads; "
        f"fp16 is emulated on CPU (~17x slower) and refused",
    )


def exit_code(findings: list[Finding]) -> int:
    """2 when any check failed: the environment must be fixed before a run can succeed."""
    return exit_codes.BAD_INPUT if any(f.level == FAIL for f in findings) else exit_codes.OK
