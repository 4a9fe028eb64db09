"""CPU precision chosen by measurement, once per machine and model, and fixed for the life of a run.

Why measure: CPU flags do not predict it. On an AMD EPYC bf16 trained ~2x faster than fp32, on an
Intel Xeon with avx512_bf16 but no AMX fastnet ran 182 images/s in bf16 and 259 in fp32. So
`train.precision=auto` on CPU times a few training steps of each (~1-2 s), caches the answer under
the cache dir keyed by CPU model, torch version, threads and model shape, and records the choice in
RUN_DIR/precision.json: a resumed run reads that record, never the cache, so it keeps the precision
it started with (exact resume) even when the cache is rewritten or deleted.

A precision set by hand stands, but one this machine trains SLOW_FACTOR times slower than the other is
named in one line at start with the figures (issue 58: a recipe's fixed bf16 ran 16x slower than fp32 on
a CPU without bf16 instructions, and nothing said so).

fp16 on CPU is emulated (~17x slower than bf16 on the smoke recipe): refused with a one-line fix.
The top of this module imports no torch, so launchers can use the messages before spawning.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchlaunch import compat, rundir
from torchlaunch.exit_codes import ConfigError
from torchlaunch.trainer_sections import refuse_fp16_on_cpu

if TYPE_CHECKING:
    import torch

    from torchlaunch.config import RunConfig
    from torchlaunch.core.dist import DistContext
    from torchlaunch.worker.data import DataBundle

CACHE_FILE = "cpu-precision.json"
FP32_MARGIN = 1.05
"""bf16 must beat fp32 by 5% to be picked: within noise, fp32 is the more exact choice."""
MEASURE_BATCH_CAP = 32
"""Timed steps use the run's micro-batch up to this size, keeping the measurement near a second."""
SLOW_FACTOR = 2.0
"""A precision set by hand that trains this many times slower than the other is named at start (issue 58:
a recipe's bf16 on a CPU without bf16 instructions ran 16x slower than fp32, silently)."""


def cpu_model() -> str:
    """The CPU's marketing name (the cache key and the figure's label in bench and doctor)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Environment variables that cap the instructions oneDNN and ATen use: with ONEDNN_MAX_CPU_ISA=AVX2 a
CPU with AMX trains bf16 ~20x slower than fp32 (5 vs 109 images/s, fastnet), as a CPU without bf16
instructions does, so the cached answer of the uncapped CPU must not be reused."""


def isa_caps() -> dict[str, str]:
    """The ISA caps in force (part of the cache key: same CPU model, other instructions)."""
    import os

    return {name: os.environ[name] for name in ISA_CAP_VARIABLES if os.environ.get(name)}


@dataclass(frozen=True)
class Rates:
    """Training images/s of one process, each precision, same model and batch, interleaved."""

    fp32: float
    bf16: float
    batch: int

    @property
    def choice(self) -> str:
        return "bf16" if self.bf16 > self.fp32 * FP32_MARGIN else "fp32"

    def why(self) -> str:
        return f"bf16 {self.bf16:.0f} vs fp32 {self.fp32:.0f} images/s"


def measure_rates(
    model_name: str,
    num_classes: int,
    width: int,
    image_size: int,
    batch: int,
    channels_last: bool,
    budget_s: float = 1.5,
) -> Rates:
    """Time training steps (forward, backward, SGD update) of fp32 and bf16 autocast, interleaved so a
    change in host load hits both; median per precision. The caller's RNG streams are untouched."""
    import torch
    import torch.nn.functional as F

    from torchlaunch.worker.models import build_model

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(model_name, num_classes, width).to(memory_format=fmt)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        x = torch.randn(batch, 3, image_size, image_size).contiguous(memory_format=fmt)
        y = torch.randint(0, num_classes, (batch,))

        def step(bf16: bool) -> float:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():  # plain SGD by hand: torch.optim's import costs ~1.3 s (torch._dynamo)
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-3)
                        p.grad = None
            return time.perf_counter() - start

        step(False), step(True)  # warm-up: allocator, oneDNN kernel selection
        times: dict[bool, list[float]] = {False: [], True: []}
        deadline = time.perf_counter() + budget_s
        while len(times[True]) < 5 and (not times[True] or time.perf_counter() < deadline):
            for bf16 in (False, True):
                times[bf16].append(step(bf16))
    return Rates(fp32=batch / statistics.median(times[False]), bf16=batch / statistics.median(times[True]), batch=batch)


def cache_key(
    model_name: str, width: int, num_classes: int, image_size: int, batch: int, channels_last: bool, threads: int
) -> str:
    """Machine (CPU model, torch, threads) + model shape: what the bf16/fp32 ratio depends on."""
    import torch

    return json.dumps(
        {
            "cpu": cpu_model(),
            "isa_caps": isa_caps(),
            "torch": str(torch.__version__),
            "threads": threads,
            "model": model_name,
            "width": width,
            "classes": num_classes,
            "size": image_size,
            "batch": batch,
            "channels_last": channels_last,
        },
        sort_keys=True,
    )


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """The run dir's atomic writer: a reader (another run, a resume) never sees half a record."""
    rundir.write_json(path, data, indent=1, sort_keys=True)


def cached_or_measured(cache_dir: Path, key: str, measure: Any) -> tuple[dict[str, Any], str]:
    """(record, source): the cache's entry for key ('cached'), else measure() and store it ('measured');
    a failed measurement picks fp32 and is not cached."""
    cache_file = cache_dir / CACHE_FILE
    entries = read_json(cache_file)
    entries = entries if isinstance(entries, dict) else {}
    hit = entries.get(key)
    if isinstance(hit, dict) and hit.get("precision") in ("bf16", "fp32"):
        return hit, "cached"
    try:
        rates: Rates = measure()
    except Exception as e:  # noqa: BLE001 - e.g. an op without bf16 kernels: fp32 always trains
        why = f"the measurement failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}), fp32 is safe"
        return {"precision": "fp32", "why": why, "cpu": cpu_model()}, "failed to measure"
    record = {
        "precision": rates.choice,
        "why": rates.why(),
        "rates": asdict(rates),
        "cpu": cpu_model(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    entries = read_json(cache_file)  # re-read: another run may have added its own entry meanwhile
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = record
    try:
        write_json(cache_file, entries)
    except OSError:
        pass  # a read-only cache dir costs a re-measurement next time, nothing more
    return record, "measured"


def choose_for_run(
    run_dir: Path,
    cache_dir: Path,
    model_name: str,
    width: int,
    num_classes: int,
    image_size: int,
    micro_batch: int,
    channels_last: bool,
) -> tuple[str, str]:
    """(precision, note) for `auto` on CPU: RUN_DIR's record when the run has one (resume), else the
    cache or a fresh measurement, then recorded in RUN_DIR. Called on one rank; broadcast by the caller."""
    import torch

    record_path = rundir.precision(run_dir)
    recorded = read_json(record_path)
    if isinstance(recorded, dict) and recorded.get("precision") in ("bf16", "fp32"):
        return recorded["precision"], (
            f"precision: auto -> {recorded['precision']} (recorded at this run's "
            f"start in {record_path}: {recorded.get('why', '')})"
        )
    batch = max(1, min(micro_batch, MEASURE_BATCH_CAP))
    key = cache_key(model_name, width, num_classes, image_size, batch, channels_last, torch.get_num_threads())
    record, source = cached_or_measured(
        cache_dir, key, lambda: measure_rates(model_name, num_classes, width, image_size, batch, channels_last)
    )
    write_json(record_path, {**record, "source": source})
    where = f"cached in {cache_dir / CACHE_FILE}" if source == "cached" else source.replace("measured", "measured now")
    return record["precision"], (
        f"precision: auto -> {record['precision']} on {record.get('cpu', cpu_model())} "
        f"({record['why']}, {model_name}, batch {batch}; {where}; recorded in {record_path})"
    )


def hand_set_note(record: dict[str, Any], hand_set: str, model_name: str) -> str | None:
    """The one start-up line for a precision set by hand that this machine trains SLOW_FACTOR times slower
    than the other (from a measurement record's rates), or None: the user's choice stands, but says its cost."""
    rates = record.get("rates")
    if not isinstance(rates, dict) or hand_set not in ("bf16", "fp32"):
        return None
    other = "fp32" if hand_set == "bf16" else "bf16"
    mine, theirs = float(rates.get(hand_set) or 0.0), float(rates.get(other) or 0.0)
    if mine <= 0.0 or theirs < mine * SLOW_FACTOR:
        return None
    return (
        f"note: train.precision={hand_set} trains {theirs / mine:.0f}x slower than {other} on "
        f"{record.get('cpu', cpu_model())} (bf16 {float(rates.get('bf16') or 0):.0f} vs fp32 "
        f"{float(rates.get('fp32') or 0):.0f} images/s, {model_name}, batch {rates.get('batch')}): "
        f"train.precision=auto picks the faster one"
    )


def check_hand_set(cfg: RunConfig, num_classes: int, image_size: int, micro_batch: int) -> str | None:
    """hand_set_note for a CPU run's bf16 set by hand, measured once per machine and model through the same
    cache as `auto` (emulated bf16 is the case that costs several times; fp32 set by hand is only checked
    against a measurement the cache already holds, so the exact choice never pays for a measurement)."""
    import torch

    hand_set = cfg.train.precision
    batch = max(1, min(micro_batch, MEASURE_BATCH_CAP))
    shape = (cfg.model.name, cfg.model.width, num_classes, image_size, batch, cfg.train.channels_last)
    key = cache_key(*shape, torch.get_num_threads())
    cache_dir = Path(cfg.data.cache_dir).expanduser()
    if hand_set == "fp32":
        entries = read_json(cache_dir / CACHE_FILE)
        record = entries.get(key) if isinstance(entries, dict) else None
    else:
        record, _ = cached_or_measured(
            cache_dir, key, lambda: measure_rates(shape[0], num_classes, shape[1], image_size, batch, shape[5])
        )
    return hand_set_note(record, hand_set, cfg.model.name) if isinstance(record, dict) else None


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` without a measurement (evaluation): bf16/fp16 on CUDA, bf16 where oneDNN supports it."""
    import torch

    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if torch.backends.mkldnn.is_available() and _cpu_bf16_ok() else "fp32"


def _cpu_bf16_ok() -> bool:
    return compat.mkldnn_bf16_supported()


def training_precision(cfg: RunConfig, ctx: DistContext, data: DataBundle) -> str:
    """The run's precision. CPU: fp16 is refused (emulated, ~17x slower); `auto` is measured once per
    machine and model and recorded in RUN_DIR, rank 0 decides for every rank; the choice replaces
    `auto` in cfg, so every checkpoint's config names it. CUDA: bf16 must be supported."""
    import torch

    from torchlaunch.core.dist import broadcast_json

    refuse_fp16_on_cpu(cfg.train.precision, ctx.device.type == "cpu")
    micro = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // ctx.world_size)
    if cfg.train.precision != "auto" or ctx.device.type != "cpu":
        chosen = resolve_precision(cfg.train.precision, ctx.device)
        if chosen == "bf16" and ctx.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.precision", "this GPU has no bf16 support", "use fp16 or fp32")
        if ctx.is_main and ctx.device.type == "cpu":
            slow = check_hand_set(cfg, data.num_classes, data.image_size, micro)
            if slow:
                note(slow)
        return chosen
    choice, line = None, ""
    if ctx.is_main:
        choice, line = choose_for_run(
            Path(cfg.run_dir),
            Path(cfg.data.cache_dir).expanduser(),
            cfg.model.name,
            cfg.model.width,
            data.num_classes,
            data.image_size,
            micro,
            cfg.train.channels_last,
        )
        note(line)
    chosen = str(broadcast_json(ctx, choice, kinds=(str,)))
    cfg.train.precision = chosen  # checkpoints then record it: evaluation validates the same way
    return chosen


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision; None for fp32 (no autocast)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
