"""`python -m train.preflight --config PATH [key=value ...]`: a distributed dry run of the job's world.

Run it exactly like the worker (same launcher, same environment contract, `-m train.preflight`
instead of `-m train`) before spending hours in a queue. Every rank joins the process group; then
they check together: all_reduce correctness and bandwidth, that no two ranks drive one GPU, that
RUN_DIR is really shared (rank 0 writes a random token, every rank must read it back), that rank 0
has room for the retained checkpoints, and that the preemption lead time covers a measured save.
Rank 0 prints one table. Every rank exits with the same code: 0 ok, 2 an environment problem to
fix (named in the table), 1 anything unexpected (e.g. the rendezvous itself failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlaunch import exit_codes
from torchlaunch.tools.machine_checks import FAIL, OK, WARN, Finding

BYTES_PER_PARAM = 4
"""fp32 master weights."""
STATE_FACTOR = 3
"""Weights + optimizer state (SGD momentum: 2x, AdamW: 3x); 3x is the safe estimate."""
IN_FLIGHT = 2
"""Checkpoints on disk besides the newest `keep`: the best one, and the one being written."""
LEAD_TIME_FACTOR = 3
"""The signal lead time must cover this many measured saves (slow disks vary, the step in flight
must finish first)."""
TOKEN_POLL_S = 10.0
"""How long a rank waits for rank 0's token to appear (NFS attribute caches lag a little)."""
PROBE_PARAMS_WHEN_UNKNOWN = 16 * 2**20
"""Parameters assumed for the save probe when the model cannot be built here (64 MiB in fp32)."""
MAX_PROBE_BYTES = 2 * 2**30
"""Largest save probe written: enough to measure the disk, small enough to stay quick."""


@dataclass(frozen=True)
class PreflightSettings:
    """The few config values the pre-flight needs."""

    run_dir: str
    keep: int = 2
    lead_time_s: float = 0.0
    timeout_s: float = 300.0
    backend: str = "auto"
    model_name: str = "simple_cnn"
    num_classes: int = 10
    width: int = 0


@dataclass(frozen=True)
class RankInfo:
    """What one rank reports about itself."""

    rank: int
    local_rank: int
    host: str
    device: str
    device_uuid: str | None
    run_dir: str
    token_seen: bool
    token_detail: str


def rank_info(value: object) -> RankInfo:
    """A peer's RankInfo from its JSON (gather_json: never a pickle), each field's type checked."""
    kinds = {f.name: f.type for f in dataclasses.fields(RankInfo)}
    if not (isinstance(value, dict) and set(value) == set(kinds)):
        raise exit_codes.BadInput("preflight error: a rank's report is not a RankInfo")
    expected = {"int": (int,), "str": (str,), "bool": (bool,), "str | None": (str, type(None))}
    for key, kind in kinds.items():
        if type(value[key]) not in expected[str(kind)]:
            raise exit_codes.BadInput(f"preflight error: a rank's report has a bad {key}")
    return RankInfo(**value)


# --------------------------------------------------------------------------- pure checks


def expected_checkpoint_bytes(num_params: int) -> int:
    """Size of one checkpoint: fp32 weights plus optimizer state."""
    return num_params * BYTES_PER_PARAM * STATE_FACTOR


def check_free_space(
    free_bytes: int, checkpoint_bytes: int, keep: int, run_dir: str, params_known: bool = True
) -> Finding:
    needed = checkpoint_bytes * (keep + IN_FLIGHT)
    what = (
        f"{_size(free_bytes)} free in {run_dir}; checkpoints need ~{_size(needed)} "
        f"({_size(checkpoint_bytes)} x (checkpoint.keep={keep} + best + one being written))"
    )
    if free_bytes < needed:
        return Finding(
            FAIL,
            "free space",
            what,
            "free space there, point run_dir at a larger filesystem, or lower checkpoint.keep (>= 2)",
        )
    if not params_known:
        return Finding(WARN, "free space", what + "; model size unknown, estimate assumed")
    return Finding(OK, "free space", what)


def check_lead_time(lead_time_s: float, save_s: float, checkpoint_bytes: int) -> Finding:
    """The warning signal must leave time for the step in flight plus a synchronous save."""
    measured = f"saving {_size(checkpoint_bytes)} took {save_s:.2f}s"
    if lead_time_s <= 0:
        return Finding(
            WARN,
            "signal lead time",
            f"preemption.lead_time_s is unknown (0); {measured}",
            "set preemption.lead_time_s to the Slurm --signal delay or the pod's terminationGracePeriodSeconds",
        )
    needed = LEAD_TIME_FACTOR * save_s
    if lead_time_s < needed:
        return Finding(
            FAIL,
            "signal lead time",
            f"lead time {lead_time_s:.0f}s < {LEAD_TIME_FACTOR} x save ({measured}): a preempted "
            "run may be killed mid-save",
            f"raise the signal delay (JobSpec.signal_delay_s / Slurm --signal=USR2@N / k8s "
            f"terminationGracePeriodSeconds) to at least {needed:.0f}s, or use faster storage",
        )
    return Finding(OK, "signal lead time", f"{lead_time_s:.0f}s covers {measured}")


def check_device_map(infos: Sequence[RankInfo]) -> list[Finding]:
    """No two ranks on one GPU, and no two ranks with the same local rank on one host."""
    findings: list[Finding] = []
    by_gpu: dict[str, list[int]] = {}
    by_slot: dict[tuple[str, int], list[int]] = {}
    for info in infos:
        if info.device_uuid:
            by_gpu.setdefault(info.device_uuid, []).append(info.rank)
        by_slot.setdefault((info.host, info.local_rank), []).append(info.rank)
    for uuid, ranks in by_gpu.items():
        if len(ranks) > 1:
            hosts = sorted({i.host for i in infos if i.rank in ranks})
            findings.append(
                Finding(
                    FAIL,
                    "device map",
                    f"ranks {_ranks(ranks)} share GPU {uuid} on {', '.join(hosts)}",
                    "start one process per GPU (--gpus = GPUs per node) and do not pin "
                    "CUDA_VISIBLE_DEVICES to one GPU for every task",
                )
            )
    for (host, local_rank), ranks in by_slot.items():
        if len(ranks) > 1:
            findings.append(
                Finding(
                    FAIL,
                    "device map",
                    f"ranks {_ranks(ranks)} all have LOCAL_RANK={local_rank} on host {host}",
                    "give each node a distinct --node-rank and let the launcher set LOCAL_RANK",
                )
            )
    if not findings:
        mapping = ", ".join(f"{i.rank}->{i.host}:{i.device}" for i in infos)
        findings.append(Finding(OK, "device map", mapping))
    return findings


def check_shared_storage(infos: Sequence[RankInfo], token_path: str) -> list[Finding]:
    """Every rank must have read rank 0's token: else its run_dir is not the same storage."""
    root = infos[0]
    findings = []
    for info in infos:
        if info.token_seen:
            continue
        findings.append(
            Finding(
                FAIL,
                "shared storage",
                f"rank {info.rank} on {info.host} cannot read the token rank 0 "
                f"({root.host}) wrote to {token_path}: its run_dir {info.run_dir} is not "
                f"the same storage ({info.token_detail})",
                "put run_dir on a filesystem every node mounts at the same path (NFS, Lustre, "
                "a ReadWriteMany volume), not a node-local folder",
            )
        )
    if not findings:
        hosts = sorted({i.host for i in infos})
        findings.append(
            Finding(
                OK,
                "shared storage",
                f"{root.run_dir} seen by all {len(infos)} rank(s) on {len(hosts)} host(s)",
            )
        )
    return findings


def check_all_reduce(results: Sequence[dict[str, Any]], world_size: int) -> list[Finding]:
    """Correctness per size (any rank wrong fails), and bandwidth as information."""
    findings = []
    wrong = [r for r in results if not r["correct"]]
    if wrong:
        sizes = ", ".join(_size(r["bytes"]) for r in wrong)
        findings.append(
            Finding(
                FAIL,
                "all_reduce",
                f"wrong sums at {sizes}",
                "a broken interconnect or NCCL setup: run the doctor on every node, try "
                "NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1 to locate it",
            )
        )
    bandwidths = ", ".join(f"{_size(r['bytes'])}: {r['bus_bytes_per_s'] / 1e9:.2f} GB/s" for r in results)
    if not wrong and world_size == 1:
        findings.append(Finding(OK, "all_reduce", "1 rank: correct, no bandwidth to measure"))
    elif not wrong:
        findings.append(Finding(OK, "all_reduce", f"{world_size} ranks correct; bus bw {bandwidths}"))
    return findings


def exit_code(findings: Sequence[Finding]) -> int:
    return exit_codes.BAD_INPUT if any(f.level == FAIL for f in findings) else exit_codes.OK


def render(findings: Sequence[Finding]) -> str:
    width = max(len(f.check) for f in findings)
    lines = ["preflight summary (rank 0)"]
    for f in findings:
        lines.append(f"  [{f.level.upper():4}] {f.check:<{width}}  {f.message}")
        if f.fix and f.level != OK:
            lines.append(f"  {'':6} {'':<{width}}  fix: {f.fix}")
    lines.append(f"preflight: {'FAILED' if exit_code(findings) else 'OK'}")
    return "\n".join(lines)


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


# --------------------------------------------------------------------------- settings


def load_settings(config_path: str, overrides: Sequence[str]) -> PreflightSettings:
    """The worker's own config loader, so the pre-flight checks what the run will use."""
    from torchlaunch import config as train_config

    cfg = train_config.load(config_path, overrides)
    classes = cfg.data.synthetic_classes if cfg.data.name == "synthetic" else 10
    return PreflightSettings(
        run_dir=str(cfg.run_dir),
        keep=cfg.checkpoint.keep,
        lead_time_s=float(cfg.preemption.lead_time_s),
        timeout_s=float(cfg.dist.timeout_s),
        backend=cfg.dist.backend,
        model_name=cfg.model.name,
        num_classes=classes,
        width=cfg.model.width,
    )


def count_parameters(settings: PreflightSettings) -> int | None:
    """Parameters of the configured model, or None when it cannot be built here."""
    try:
        from torchlaunch.worker.models import build_model

        model = build_model(settings.model_name, settings.num_classes, settings.width)
    except Exception:  # noqa: BLE001 - the estimate falls back and the table says so
        return None
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- the distributed part


def measure_all_reduce(ctx: Any, sizes_bytes: Sequence[int], iters: int = 3) -> list[dict[str, Any]]:
    """Sum of rank-dependent tensors at a few sizes: correctness, then timed bus bandwidth.

    The iteration count is fixed (not a time budget) so every rank runs the same collectives.
    """
    import torch
    import torch.distributed as dist

    world = ctx.world_size
    results = []
    for size in sizes_bytes:
        n = max(1, size // 4)
        base = torch.arange(n, dtype=torch.float32, device=ctx.device) % 1024
        tensor = base + ctx.rank
        dist.all_reduce(tensor)
        expected = base * world + world * (world - 1) / 2
        correct = bool(torch.equal(tensor, expected))
        _sync(ctx)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        _sync(ctx)
        local = (time.perf_counter() - start) / iters
        slowest = torch.tensor([local, 0.0 if correct else 1.0], device=ctx.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds, any_wrong = slowest.tolist()
        alg_bw = n * 4 / seconds if seconds > 0 else float("inf")
        results.append(
            {
                "bytes": n * 4,
                "seconds": seconds,
                "correct": any_wrong == 0.0,
                "bus_bytes_per_s": alg_bw * 2 * (world - 1) / world if world > 1 else alg_bw,
            }
        )
    return results


def _sync(ctx: Any) -> None:
    import torch

    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def default_sizes(device_type: str, max_mib: float) -> list[int]:
    sizes = [2**16, 2**20, 2**24, 2**26, 2**28] if device_type == "cuda" else [2**16, 2**20, 2**23]
    return [s for s in sizes if s <= max_mib * 2**20] or [sizes[0]]


def _device_uuid(device: Any) -> str | None:
    import torch

    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def read_token(path: Path, token: str, deadline_s: float) -> tuple[bool, str]:
    """Poll (bounded) for rank 0's token: shared filesystems may show a new file a little late."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            seen = path.read_text()
        except FileNotFoundError:
            detail = "file not found"
        except OSError as exc:
            detail = f"{type(exc).__name__}: {exc}"
        else:
            if seen == token:
                return True, "token matches"
            detail = "a different token (another run's file?)"
        if time.monotonic() >= deadline:
            return False, f"{detail} after {deadline_s:.0f}s"
        time.sleep(0.2)


def _write_token(path: Path, token: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(token)
        fh.flush()
        os.fsync(fh.fileno())


def measure_save(directory: Path, num_bytes: int) -> float:
    """Seconds to torch.save + fsync a checkpoint-sized state, as rank 0 will at preemption."""
    import torch

    probe = directory / f".preflight-save-{secrets.token_hex(4)}.pt"
    state = {"probe": torch.ones(max(1, num_bytes // 4), dtype=torch.float32)}
    start = time.perf_counter()
    try:
        with open(probe, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return time.perf_counter() - start
    finally:
        probe.unlink(missing_ok=True)


def run_checks(
    ctx: Any,
    settings: PreflightSettings,
    max_mib: float,
    rendezvous_s: float,
    token_wait_s: float = TOKEN_POLL_S,
) -> tuple[int, str]:
    """All ranks call this together; returns the exit code and reason every rank agrees on."""
    import torch.distributed as dist

    from torchlaunch.core.dist import DistContext, broadcast_json, gather_json

    wire = DistContext(ctx.rank, ctx.world_size, ctx.local_rank, 1, ctx.device, dist.get_backend())
    host = socket.gethostname()
    run_dir = Path(settings.run_dir).absolute()
    findings: list[Finding] = [Finding(OK, "rendezvous", f"{ctx.world_size} rank(s) joined in {rendezvous_s:.2f}s")]

    results = measure_all_reduce(ctx, default_sizes(ctx.device.type, max_mib))
    findings += check_all_reduce(results, ctx.world_size)

    # Shared storage: rank 0 writes, every rank reads its own view of run_dir.
    token = name = ""
    if ctx.rank == 0:
        token = secrets.token_hex(16)
        name = f".preflight-token-{token[:8]}"
        _write_token(run_dir / name, token)
    token = str(broadcast_json(wire, token, kinds=(str,), max_bytes=256))
    name = f".preflight-token-{token[:8]}"
    seen, detail = read_token(run_dir / name, token, token_wait_s)
    info = RankInfo(
        rank=ctx.rank,
        local_rank=ctx.local_rank,
        host=host,
        device=str(ctx.device),
        device_uuid=_device_uuid(ctx.device),
        run_dir=str(run_dir),
        token_seen=seen,
        token_detail=detail,
    )
    infos = sorted(
        (rank_info(v) for v in gather_json(wire, dataclasses.asdict(info), max_bytes=65536)), key=lambda i: i.rank
    )
    findings += check_device_map(infos)
    findings += check_shared_storage(infos, str(run_dir / name))

    if ctx.rank == 0:
        (run_dir / name).unlink(missing_ok=True)
        num_params = count_parameters(settings)
        params = num_params if num_params is not None else PROBE_PARAMS_WHEN_UNKNOWN
        checkpoint_bytes = expected_checkpoint_bytes(params)
        free = shutil.disk_usage(run_dir).free
        findings.append(check_free_space(free, checkpoint_bytes, settings.keep, str(run_dir), num_params is not None))
        probe_bytes = min(checkpoint_bytes, MAX_PROBE_BYTES, max(free // 4, 1))
        save_s = measure_save(run_dir, probe_bytes) * checkpoint_bytes / probe_bytes
        findings.append(check_lead_time(settings.lead_time_s, save_s, checkpoint_bytes))
        print(render(findings), flush=True)
    failed = [f for f in findings if f.level == FAIL]
    reason = f"preflight: {failed[0].check}: {failed[0].message}" if failed else "preflight ok"
    verdict = broadcast_json(wire, [exit_code(findings), reason], kinds=(list,), max_bytes=65536)
    code, reason = verdict if len(verdict) == 2 else (None, None)  # type: ignore[arg-type, misc]
    if type(code) is not int or not isinstance(reason, str):
        raise exit_codes.BadInput("preflight error: rank 0's verdict is not [code, reason]")
    return code, reason


# --------------------------------------------------------------------------- process setup


@dataclass(frozen=True)
class _Context:
    """The slice of torchlaunch.core.dist.DistContext the checks use."""

    rank: int
    world_size: int
    local_rank: int
    device: Any


def _setup(settings: PreflightSettings) -> tuple[_Context, Callable[[bool], None]]:
    """Join the job's process group exactly as the worker does (torchlaunch.core.dist), and a teardown.

    Without a launcher it makes a one-rank group on an in-memory store, so the same checks run.
    """
    import torch.distributed as dist

    from torchlaunch.core import dist as train_dist

    ctx = train_dist.setup(timeout_s=settings.timeout_s, backend=settings.backend)
    if ctx.distributed:
        context = _Context(ctx.rank, ctx.world_size, ctx.local_rank, ctx.device)
        return context, lambda clean: train_dist.teardown(ctx, clean=clean)
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return _Context(0, 1, 0, ctx.device), lambda clean: dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of the pre-flight, run by torchlaunch.runner like any program: a failed check is
    BadInput (its one line, exit 2, never retried), a rendezvous that never formed is exit 1."""
    parser = argparse.ArgumentParser(prog="python -m train.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's YAML (or RUN_DIR/config.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value, as for the worker")
    parser.add_argument("--max-mib", type=float, default=256.0, help="largest all_reduce size measured (MiB)")
    parser.add_argument(
        "--token-wait-s",
        type=float,
        default=TOKEN_POLL_S,
        help="how long each rank waits for rank 0's token in run_dir",
    )
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, args.overrides)
        code, reason = _run(settings, args.max_mib, args.token_wait_s)
    except exit_codes.BadInput as exc:
        raise exit_codes.BadInput(f"preflight: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # noqa: BLE001 - a failed rendezvous is this tool's finding, not its crash
        print(
            f"preflight: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
            "(check that every node started and can reach MASTER_ADDR:MASTER_PORT)",
            file=sys.stderr,
            flush=True,
        )
        return exit_codes.FAILURE
    if code == exit_codes.BAD_INPUT:
        raise exit_codes.BadInput(reason)
    return code


def _run(settings: PreflightSettings, max_mib: float, token_wait_s: float) -> tuple[int, str]:
    import torch.distributed  # noqa: F401 - imported before the rendezvous clock starts

    start = time.perf_counter()
    ctx, teardown = _setup(settings)
    rendezvous_s = time.perf_counter() - start
    clean = False
    try:
        result = run_checks(ctx, settings, max_mib, rendezvous_s, token_wait_s)
        clean = True
        return result
    finally:
        teardown(clean)


if __name__ == "__main__":
    from torchlaunch import pdeath, runner

    pdeath.die_with_agent()  # torchrun starts ranks in sessions of their own: end with it
    runner.exit_process(runner.main(["-m", runner.PREFLIGHT, *sys.argv[1:]]))
