"""Data checks that need no torch: run by the launchers before they spawn anything (each format's
pre-check is registered in torchlaunch.data.formats; check_data asks the registry).

Why a module of its own: the worker finds a missing dataset only after torchrun has started every
process and each has imported torch and tried the download (~29 s for 4 workers offline). The same
questions (is the data there, could it be downloaded, does the folder hold images) can be answered in
a fraction of a second from the launcher, with the same one line the worker would print.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from pathlib import Path

from torchlaunch import contract
from torchlaunch.config import DataConfig
from torchlaunch.exit_codes import BadInput

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
"""Where torchvision downloads CIFAR-10 from (torchvision.datasets.CIFAR10.url)."""
PROBE_ENV = contract.DOWNLOAD_PROBE
PROBE_TIMEOUT_S = 1.5
"""Name lookup + TCP connect together; offline machines answer in ms or hang, so this bounds both."""


def cifar10_missing_message(root: Path, reason: str, tried_download: bool) -> str:
    """The one line for a missing CIFAR-10, shared by the worker (torchlaunch.worker.data) and the launchers."""
    first_fix = "run once with internet access" if tried_download else "set data.download=true when online"
    return (
        f"data error: CIFAR-10 not found under {root / 'cifar-10-batches-py'} ({reason}): {first_fix}, "
        f"or point data.root at a folder holding cifar-10-batches-py, or use data.name=imagefolder "
        f"data.root=<folder of class folders>"
    )


def probe_target(url: str = CIFAR10_URL, env: dict[str, str] | None = None) -> tuple[str, int]:
    """(host, port) a download would connect to first: the override, the HTTPS proxy, or the URL's host."""
    env = dict(os.environ) if env is None else env
    override = env.get(PROBE_ENV)
    if override:
        host, _, port = override.rpartition(":")
        return host, int(port)
    proxy = next((env[k] for k in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY") if env.get(k)), None)
    parsed = urllib.parse.urlsplit(proxy if proxy and "://" in proxy else (f"http://{proxy}" if proxy else url))
    return parsed.hostname or "", parsed.port or (443 if parsed.scheme == "https" else 80)


def unreachable_reason(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when host:port accepts a TCP connection within timeout_s, else why not. The lookup runs in
    a daemon thread because getaddrinfo has no timeout of its own."""
    outcome: dict[str, str | None] = {"reason": "no answer"}

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                outcome["reason"] = None
        except OSError as e:
            outcome["reason"] = str(e) or type(e).__name__

    thread = threading.Thread(target=attempt, daemon=True, name="download-probe")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    return None if outcome["reason"] is None else f"{host}:{port}: {outcome['reason']}"


def check_cifar10(cfg: DataConfig, probe: bool) -> None:
    """Present, or downloadable (probe=True: the download host answers)."""
    root = Path(cfg.root).expanduser()
    if (root / "cifar-10-batches-py" / "test_batch").is_file():
        return
    if not cfg.download:
        raise BadInput(cifar10_missing_message(root, "download is off", False))
    if probe:
        host, port = probe_target()
        reason = unreachable_reason(host, port)
        if reason is not None:
            raise BadInput(cifar10_missing_message(root, f"download host unreachable: {reason}", True))


def check_data(cfg: DataConfig, *, local: bool) -> None:
    """Raise BadInput with the worker's line for data the workers could not load: the format's own
    pre-check, found in the registry (torchlaunch.data.registry).

    local=False (Slurm, Kubernetes): the data may live only where the job runs, so a root that is not
    visible here is not judged, and CIFAR-10's download is not probed (compute nodes may be online).
    Formats without a pre-check (synthetic; plug-ins, whose data is the plug-in's business) pass through."""
    from torchlaunch.data import registry

    fmt = registry.get(cfg.name)
    if fmt.precheck is None:
        return
    if not local and fmt.root != "unused" and not Path(cfg.root).expanduser().exists():
        return
    fmt.precheck(cfg, local)


def check_imagefolder(cfg: DataConfig, local: bool) -> None:
    """At least 2 images under the class folders: one to train on, one to hold out."""
    from torchlaunch.data.folders import scan_imagefolder  # PIL, no torch

    _, files, _ = scan_imagefolder(Path(cfg.root).expanduser())
    if len(files) < 2:
        raise BadInput(
            f"data error: {cfg.root} has only {len(files)} image(s); need at least 2 to hold "
            f"out a validation split (add images)"
        )


def check_shard_set(cfg: DataConfig, local: bool) -> None:
    """The registry's pre-check of data.name=shards (check_shards on the configured root and label)."""
    check_shards(Path(cfg.root).expanduser(), cfg.shard_label)


def check_cifar10_data(cfg: DataConfig, local: bool) -> None:
    """The registry's pre-check of data.name=cifar10: the download host is probed only when local."""
    check_cifar10(cfg, probe=local)


def check_shards(root: Path, label: str = "cls") -> None:
    """A shard set every rank can open: train/ and val/ present with indexes matching their shards
    (ShardSet.open checks them), the same classes in both, at least 2, and the first sample of each
    split decodable. Reads two samples, not the set: a member damaged further in is named by the
    worker that reads it (and by `python -m train.shards verify`)."""
    from torchlaunch.shards import ShardSet, decode  # numpy + PIL, no torch

    splits = {name: ShardSet.open(root / name, label=label, remember=True) for name in ("train", "val")}
    train, val = splits["train"], splits["val"]
    if list(train.classes) != list(val.classes) or len(train.classes) < 2:
        raise BadInput(
            f"data error: {root}: train/ has {len(train.classes)} classes and val/ {len(val.classes)}; both need "
            "the same list of at least 2 (rewrite the set with python -m train.shards write)"
        )
    for s in (train, val):
        if len(s) == 0:
            raise BadInput(
                f"data error: {s.folder} holds no samples (rewrite the set with python -m train.shards write)"
            )
        decode(s.read(0), s.where(0), None)
