"""Pre-spawn checks: what the launcher can find wrong before starting any worker, without torch.

Why: a worker reports a missing dataset or fp16 on CPU only after torchrun has started every
process and each has imported torch (~29 s for 4 offline workers on CIFAR-10). Here the same one
line comes in well under a second: config (already loaded by the caller), data, precision, GPUs.

    every launcher, every mode:  fp16 on CPU workers, train.exact's cut of the batch (check; live
                                 mode's rules are each launcher's own)
    training (run, --dry-run):   data present or downloadable, image folder non-empty
    local (launch.local):        GPUs visible; remote (launch.slurm, launch.k8s): only what this
                                 host can see (see torchlaunch.data.checks)
"""

from __future__ import annotations

import os
from pathlib import Path

from torchlaunch.base.untrusted import whole
from torchlaunch.config import RunConfig
from torchlaunch.core.grid_cut import check_grid
from torchlaunch.data.checks import check_data
from torchlaunch.trainer_sections import refuse_fp16_on_cpu

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
GPU_DEVICE_NODES = (Path("/dev/nvidiactl"), Path("/dev/kfd"))


def visible_gpus_without_torch(
    env: dict[str, str] | None = None,
    nvidia_gpus: Path = NVIDIA_GPUS,
    device_nodes: tuple[Path, ...] = GPU_DEVICE_NODES,
) -> int | None:
    """The visible GPU count when it is certain without loading CUDA, else None (ask torch).

    0 when CUDA_VISIBLE_DEVICES hides every GPU or no GPU driver is loaded at all (torch would say
    the same after ~2 s of import); the NVIDIA driver's per-GPU folders, capped by
    CUDA_VISIBLE_DEVICES, otherwise. Anything else (ROCm, odd masks) is left to torch."""
    env = dict(os.environ) if env is None else env
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is not None and mask.strip() in ("", "-1"):
        return 0
    if nvidia_gpus.is_dir():
        found = sum(1 for _ in nvidia_gpus.iterdir())
        if mask is None:
            return found
        entries = [whole(e.strip(), 6) for e in mask.split(",")]
        if all(e is not None and e < found for e in entries):
            return len(entries)
        return None
    if not any(node.exists() for node in device_nodes):
        return 0
    return None


def check(cfg: RunConfig, *, on_cpu: bool, local: bool, doctor: bool = False) -> None:
    """The one pre-spawn policy of every launcher, the same in a run, --dry-run and --doctor:
    BadInput (one line, exit 2) for what every worker would fail on.

    fp16 on CPU workers is refused in every mode: the recipe would fail the same way when it trains,
    and the doctor is there to say so first. The data is judged whenever the job trains (run and
    --dry-run); --doctor runs the pre-flight, which reads no data, so a dataset still to be fetched
    must not stop it. local=False (Slurm, Kubernetes): the job runs elsewhere, so the data is judged
    only where this host can see it and no download is probed (compute nodes may reach the internet
    when we cannot)."""
    refuse_fp16_on_cpu(cfg.train.precision, on_cpu)
    check_grid(cfg.train)
    if not doctor:
        check_data(cfg.data, local=local)
