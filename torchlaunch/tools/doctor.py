"""`python -m train.doctor`: is this machine able to train at all?

Most failed runs die of their environment (a CPU-only torch on a GPU machine, a GPU hidden by
CUDA_VISIBLE_DEVICES, a driver older than the CUDA runtime), and they die hours into a queue. This
module gathers facts once (`gather_facts`), judges them with pure functions (`check_facts`, so each
failure case is unit-testable with a hand-written facts dict) and prints a table or JSON.

Exit codes: 0 when every check passes (warnings allowed), 2 when something must be fixed first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from torchlaunch import exit_codes

NVIDIA_SMI_TIMEOUT_S = 5.0
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


# --------------------------------------------------------------------------- gathering facts


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


def format_cudnn(version: int | None) -> str:
    """torch reports cuDNN as one int: 92400 is 9.24.0 (9.x packs 10000/100), 8907 is 8.9.7."""
    if version is None:
        return "none"
    if version >= 90000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


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


# --------------------------------------------------------------------------- pure checks


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


# --------------------------------------------------------------------------- rendering


def _gib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def render_table(facts: dict[str, Any], findings: list[Finding]) -> str:
    """A human-readable report: versions, one row per device, then the findings with fixes."""
    lines = []
    torch_facts = facts.get("torch", {})
    dist = facts.get("distributed", {})
    smi = facts.get("nvidia_smi", {})
    summary = [
        ("python", f"{facts['python']['version']} ({facts['python']['executable']})"),
        ("torch", torch_facts.get("version", "not importable")),
        ("CUDA runtime", str(torch_facts.get("cuda_build"))),
        ("CUDA driver", str(smi.get("driver_version"))),
        ("cuDNN", format_cudnn(torch_facts.get("cudnn_version"))),
        ("NCCL", str(dist.get("nccl_version")) if dist.get("nccl") else "no"),
        ("gloo", "yes" if dist.get("gloo") else "no"),
        ("CUDA_VISIBLE_DEVICES", str(facts.get("env", {}).get("CUDA_VISIBLE_DEVICES"))),
    ]
    width = max(len(k) for k, _ in summary)
    lines += [f"{k:<{width}}  {v}" for k, v in summary]
    lines.append("")
    header = ("device", "name", "memory", "cap", "bf16", "fp16", "conv fwd+bwd")
    rows = [header]
    for d in facts.get("devices", []):
        smoke = d.get("smoke")
        smoke_text = "-" if smoke is None else (f"ok {smoke['seconds']:.3f}s" if smoke["ok"] else "FAILED")
        rows.append(
            (
                d["device"],
                str(d["name"])[:32],
                _gib(d.get("memory_bytes")),
                d.get("capability") or "-",
                _yes_no(d.get("bf16")),
                _yes_no(d.get("fp16")),
                smoke_text,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    lines.append("")
    for f in findings:
        lines.append(f"[{f.level.upper():4}] {f.check}: {f.message}")
        if f.fix and f.level != OK:
            lines.append(f"       fix: {f.fix}")
    verdict = "FAILED" if exit_code(findings) else "OK"
    lines.append(f"doctor: {verdict}")
    return "\n".join(lines)


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--model",
        default="simple_cnn",
        help="model whose CPU training rate is timed in fp32 and bf16, e.g. fastnet ('' skips it)",
    )
    parser.add_argument(
        "--config", default=None, help="also check that this config's plug-ins (pkg.module:factory) import"
    )
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides of --config, e.g. model.name=examples.my_models:tiny_cnn"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    facts = gather_facts(model=args.model)
    if args.config or args.overrides:
        facts["plugins"] = plugin_facts(args.config, args.overrides)
    findings = check_facts(facts)
    facts["seconds"] = round(time.perf_counter() - start, 3)
    code = exit_code(findings)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": code == 0,
                    "exit_code": code,
                    "facts": facts,
                    "findings": [asdict(f) for f in findings],
                },
                indent=2,
                default=str,
            )
        )
    else:
        print(render_table(facts, findings))
    return code


if __name__ == "__main__":
    sys.exit(main())
