"""The launchers' data check before they spawn anything: the format's own pre-check, found in the
registry (each format's pre-check is in its module, torchlaunch.data.formats.*).

Why torch-free and before any rank: the worker finds missing data only after torchrun has started
every process and each has imported torch; the same question answered here costs a fraction of a
second and prints the line the worker would print.
"""

from __future__ import annotations

from pathlib import Path

from torchlaunch.data import registry


def check_data(cfg: registry.DataConfig, *, local: bool) -> None:
    """Raise BadInput with the worker's line for data the workers could not load: the format's own
    pre-check, found in the registry (torchlaunch.data.registry).

    local=False (Slurm, Kubernetes): the data may live only where the job runs, so a root that is not
    visible here is not judged, and CIFAR-10's download is not probed (compute nodes may be online).
    Formats without a pre-check (synthetic; plug-ins, whose data is the plug-in's business) pass through."""
    fmt = registry.get(cfg.name)
    if fmt.precheck is None:
        return
    if not local and fmt.root != "unused" and not Path(cfg.root).expanduser().exists():
        return
    fmt.precheck(cfg, local)
