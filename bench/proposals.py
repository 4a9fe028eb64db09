"""Fast paths adopted in train/, kept measured against what they replaced: each is a ratio of the
adopted variant against the previous one, interleaved, median of rounds, so a torch or library
upgrade that erases the gain shows up here.

- optimizer: SGD(fused=True) (torchlaunch.worker.optim.build_optimizer) ÷ SGD(foreach=True), resnet18 step;
- checksum: verifying a checkpoint with xxh3-128 (torchlaunch.core.checkpoint) ÷ with sha256, 89 MB.
(The data-path comparison is measured inside the data-path benchmark.)"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path

import torch
import xxhash

from bench.common import Result, median, median_ratio, paired_rates
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.worker.models import build_model

COMMAND = "python -m bench.run --only proposals"


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def optimizer(model: str, rounds: int) -> Result:
    net = build_model(model, 10)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    kw = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    fused = torch.optim.SGD(net.parameters(), fused=True, **kw)
    foreach = torch.optim.SGD(net.parameters(), foreach=True, **kw)
    rates = paired_rates(
        {"fused": lambda: 1 / _seconds(fused.step), "foreach": lambda: 1 / _seconds(foreach.step)}, rounds
    )
    ratio, per_round = median_ratio(rates["fused"], rates["foreach"])
    params = sum(p.numel() for p in net.parameters()) / 1e6
    return Result(
        key="proposal_fused_sgd",
        title="Adopted: fused SGD step ÷ foreach SGD step (steps/s)",
        project=median(rates["fused"]),
        baseline=median(rates["foreach"]),
        unit="steps/s",
        ratio=ratio,
        goal=1.0,
        higher_is_better=True,
        command=COMMAND,
        project_label="SGD(fused=True) on CPU, what torchlaunch uses",
        baseline_label="SGD(foreach=True), the previous default",
        rounds=per_round,
        notes=f"{model} ({params:.1f} M parameters), optimizer step only, nesterov + weight decay, "
        f"{torch.get_num_threads()} thread(s)",
    )


def checksum(model: str, rounds: int) -> Result:
    net = build_model(model, 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    root = Path(tempfile.mkdtemp(prefix="bench-crc-"))
    info = ckpt.write_checkpoint(
        root, 1, {"format_version": ckpt.FORMAT_VERSION, "model": net.state_dict(), "optimizer": opt.state_dict()}, {}
    )
    state = info.path / ckpt.STATE_FILE

    def stream(update) -> None:
        with open(state, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                update(block)

    def xxh3() -> float:
        h = xxhash.xxh3_128()
        return 1 / _seconds(lambda: stream(h.update))

    def sha() -> float:
        h = hashlib.sha256()
        return 1 / _seconds(lambda: stream(h.update))

    def verify_load() -> float:
        return 1 / _seconds(lambda: ckpt.load_state(info.path))

    def plain_load() -> float:
        return 1 / _seconds(lambda: torch.load(state, weights_only=True))

    rates = paired_rates({"xxh3": xxh3, "sha": sha, "load": verify_load, "plain": plain_load}, rounds)
    ratio, per_round = median_ratio(rates["xxh3"], rates["sha"])
    return Result(
        key="adopted_xxh3",
        title="Adopted: checkpoint verify with xxh3-128 ÷ with sha256 (passes/s)",
        project=median(rates["xxh3"]),
        baseline=median(rates["sha"]),
        unit="passes/s",
        ratio=ratio,
        goal=1.0,
        higher_is_better=True,
        command=COMMAND,
        project_label="xxh3-128 over the state file, what torchlaunch.core.checkpoint uses",
        baseline_label="hashlib.sha256, the previous checksum",
        rounds=per_round,
        notes=f"{info.size / 1e6:.0f} MB state file ({model} + SGD), page cache warm; plain torch.load "
        f"{1 / median(rates['plain']):.3f} s, load_state (verify + load) "
        f"{1 / median(rates['load']):.3f} s",
    )


def run(quick: bool = False, rounds: int = 7) -> list[Result]:
    model = "simple_cnn" if quick else "resnet18"
    r = 2 if quick else rounds
    return [optimizer(model, r), checksum(model, r)]
