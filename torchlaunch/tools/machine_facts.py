"""The doctor's facts about this machine, gathered once as plain JSON-able data: the only impure part of
`python -m train.doctor` (nvidia-smi, torch's view of CUDA and its collectives, a conv forward+backward on
each device, the CPU's fp32/bf16 rates, a config's plug-ins). torchlaunch.tools.machine_checks judges
them; keeping the two apart makes every failure case a unit test with a hand-written facts dict.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any

NVIDIA_SMI_TIMEOUT_S = 5.0


def _nvidia_smi_facts() -> dict[str, Any]:
    """GPUs as the driver sees them; nvidia-smi ignores CUDA_VISIBLE_DEVICES, which is the point."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"present": False, "gpus": [], "driver_version": None, "error": None}
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"present": True, "gpus": [], "driver_version": None, "error": str(exc)}
    if out.returncode != 0:
        error = (out.stderr or out.stdout).strip().splitlines()
        return {
            "present": True,
            "gpus": [],
            "driver_version": None,
            "error": error[0] if error else f"exit {out.returncode}",
        }
    gpus, driver = [], None
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "memory_mib": _to_int(parts[2])})
            driver = parts[1]
    return {"present": True, "gpus": gpus, "driver_version": driver, "error": None}


def _to_int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def _smoke_test(device: str) -> dict[str, Any]:
    """A tiny conv forward + backward: proves kernels, autograd and memory work on `device`."""
    import torch

    start = time.perf_counter()
    try:
        generator = torch.Generator().manual_seed(0)
        conv = torch.nn.Conv2d(3, 8, kernel_size=3, padding=1).to(device)
        images = torch.randn(2, 3, 16, 16, generator=generator).to(device)
        loss = conv(images).square().mean()
        loss.backward()
        grad = conv.weight.grad
        if grad is None or not bool(torch.isfinite(grad).all()):
            raise RuntimeError("gradient missing or not finite")
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return {"ok": True, "seconds": round(time.perf_counter() - start, 4), "error": None}
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        return {
            "ok": False,
            "seconds": round(time.perf_counter() - start, 4),
            "error": f"{type(exc).__name__}: {_first_line(str(exc))}",
        }


def _dtype_works(device: str, dtype_name: str) -> bool:
    """Whether a conv runs under autocast with this dtype on this device (measured, not assumed)."""
    import torch

    dtype = getattr(torch, dtype_name)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    try:
        conv = torch.nn.Conv2d(3, 4, kernel_size=3).to(device)
        with torch.autocast(device_type=device_type, dtype=dtype):
            conv(torch.ones(1, 3, 8, 8, device=device)).float().sum().item()
        return True
    except Exception:  # noqa: BLE001 - "does not work" is the answer
        return False


def _cpu_rates(model: str) -> dict[str, Any]:
    """Training images/s in fp32 and bf16 on this CPU (torchlaunch/worker/precision.py's measurement, ~1-2 s):
    CPU flags do not say which is faster, so `precision=auto` measures and so does the doctor."""
    import torch

    from torchlaunch.worker.precision import measure_rates

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core: steady on a busy host, where 2 OMP threads stall each other
    try:
        rates = measure_rates(model, 10, 0, 32, 32, channels_last=True, budget_s=0.5)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, not fatal
        return {"model": model, "error": f"{type(exc).__name__}: {_first_line(str(exc))}"}
    finally:
        torch.set_num_threads(threads)
    return {
        "model": model,
        "batch": rates.batch,
        "threads": 1,
        "fp32": round(rates.fp32, 1),
        "bf16": round(rates.bf16, 1),
        "auto_picks": rates.choice,
    }


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gather_facts(run_smoke_tests: bool = True, model: str = "simple_cnn") -> dict[str, Any]:
    """Everything the checks need, as plain JSON-able data (the only impure part of the doctor)."""
    facts: dict[str, Any] = {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": {
            "system": platform.system(),
            "machine": platform.machine(),
            "hostname": platform.node(),
            "cpu_count": os.cpu_count(),
        },
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS")},
        "nvidia_smi": _nvidia_smi_facts(),
    }
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - a broken install is itself the finding
        facts["torch"] = {"importable": False, "error": f"{type(exc).__name__}: {exc}"}
        facts["devices"] = []
        return facts

    cuda_error = None
    try:
        cuda_available = torch.cuda.is_available()
        device_count = torch.cuda.device_count() if cuda_available else 0
    except Exception as exc:  # noqa: BLE001
        cuda_available, device_count, cuda_error = False, 0, f"{type(exc).__name__}: {exc}"
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    dist_available = dist.is_available()
    nccl_version = None
    if dist_available and dist.is_nccl_available():
        try:
            nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError) as exc:
            nccl_version = f"unknown ({exc})"
    facts["torch"] = {
        "importable": True,
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cudnn_version": cudnn_version,
    }
    facts["cuda"] = {"available": cuda_available, "device_count": device_count, "error": cuda_error}
    facts["distributed"] = {
        "available": dist_available,
        "gloo": dist_available and dist.is_gloo_available(),
        "nccl": dist_available and dist.is_nccl_available(),
        "nccl_version": nccl_version,
    }

    devices: list[dict[str, Any]] = [
        {
            "device": "cpu",
            "name": _cpu_name(),
            "memory_bytes": _cpu_memory_bytes(),
            "capability": None,
            "bf16": _dtype_works("cpu", "bfloat16") if run_smoke_tests else None,
            "fp16": _dtype_works("cpu", "float16") if run_smoke_tests else None,
            "rates": _cpu_rates(model) if run_smoke_tests and model else None,
        }
    ]
    for index in range(device_count):
        props = torch.cuda.get_device_properties(index)
        device = f"cuda:{index}"
        devices.append(
            {
                "device": device,
                "name": props.name,
                "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}",
                "bf16": bool(torch.cuda.is_bf16_supported()) if run_smoke_tests else None,
                "fp16": (props.major, props.minor) >= (5, 3),
            }
        )
    for entry in devices:
        entry["smoke"] = _smoke_test(entry["device"]) if run_smoke_tests else None
    facts["devices"] = devices
    return facts


def plugin_facts(config: str | None, overrides: list[str]) -> list[dict[str, Any]]:
    """Which plug-ins (`model.name` / `data.name` = `pkg.module:factory`) of a config import, and from
    which file: imported the way the worker does (current directory first, then PYTHONPATH), no
    factory is called. A broken config is itself one failed entry."""
    from torchlaunch import config as config_mod
    from torchlaunch.exit_codes import BadInput

    try:
        cfg = config_mod.load(config, overrides)
    except BadInput as exc:
        return [{"key": "config", "name": config, "ok": False, "file": None, "error": str(exc)}]
    from torchlaunch.worker import plugins

    found = []
    if cfg.data.name == "shards":  # the shard set's indexes, classes and first samples, as the pre-check reads them
        import pathlib

        from torchlaunch.data.formats.shards import check_shards

        root = pathlib.Path(cfg.data.root).expanduser()
        try:
            check_shards(root, cfg.data.shard_label)
            found.append({"key": "data.root", "name": "shard set", "ok": True, "file": str(root), "error": None})
        except BadInput as exc:
            found.append({"key": "data.root", "name": "shard set", "ok": False, "file": None, "error": str(exc)})
    for key, name in (("model.name", cfg.model.name), ("data.name", cfg.data.name)):
        if not plugins.is_plugin(name):
            continue
        try:
            plugins.resolve(key, name)
            found.append(
                {"key": key, "name": name, "ok": True, "file": plugins.origin(key, name)["file"], "error": None}
            )
        except BadInput as exc:
            found.append({"key": key, "name": name, "ok": False, "file": None, "error": str(exc)})
    return found
