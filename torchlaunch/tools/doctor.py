"""`python -m train.doctor`: is this machine able to train at all?

Most failed runs die of their environment (a CPU-only torch on a GPU machine, a GPU hidden by
CUDA_VISIBLE_DEVICES, a driver older than the CUDA runtime), and they die hours into a queue. This
module gathers facts once (torchlaunch.tools.machine_facts), judges them with pure functions
(torchlaunch.tools.machine_checks, so each failure case is unit-testable with a hand-written facts dict)
and prints a table or JSON.

Exit codes: 0 when every check passes (warnings allowed), 2 when something must be fixed first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import Any

from torchlaunch.tools.machine_checks import OK, Finding, check_facts, exit_code
from torchlaunch.tools.machine_facts import gather_facts, plugin_facts


def format_cudnn(version: int | None) -> str:
    """torch reports cuDNN as one int: 92400 is 9.24.0 (9.x packs 10000/100), 8907 is 8.9.7."""
    if version is None:
        return "none"
    if version >= 90000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


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
