"""bench.links's plain-DDP side: the loop a user writes with torch's DDP, as a program under the
launcher's restart road (`launch.local --nnodes N ... -- bench/links_ddp.py`): resnet18 (the project's
CIFAR variant) at 32 px, one synthetic batch per rank kept in memory, SGD; DDP's own buckets and
all-reduce, no comm hook. Rank 0 prints one JSON line: the median images/s over windows of WINDOW
steps after the first (the first step's allocations and DDP's bucket rebuild excluded)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from torchlaunch.worker.models import build_model

GLOBAL_BATCH = 16
WINDOW = 8


def main(steps: int) -> int:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model("resnet18", 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(GLOBAL_BATCH // world, 3, 32, 32)
    y = torch.randint(0, 10, (GLOBAL_BATCH // world,))
    rates = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step % WINDOW == 0:
            now = time.perf_counter()
            rates.append(WINDOW * GLOBAL_BATCH / (now - started))
            started = now
    if dist.get_rank() == 0:
        print("links_ddp:", json.dumps({"images_per_s": statistics.median(rates[1:]), "windows": rates}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 48))
