"""The cifar10 data format: torchvision's CIFAR-10 python batches. One module: its config section,
its torch-free pre-check (present, or downloadable) and its registry entry.

Why the pre-check is here and torch-free: the worker finds a missing dataset only after torchrun has
started every process and each has imported torch and tried the download (~29 s for 4 workers
offline); the launcher answers the same question in a fraction of a second, with the worker's line.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from torchlaunch import contract
from torchlaunch.data.registry import DataConfig, DataFormat, lazy, register
from torchlaunch.exit_codes import BadInput

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
"""Where torchvision downloads CIFAR-10 from (torchvision.datasets.CIFAR10.url)."""
PROBE_ENV = contract.DOWNLOAD_PROBE
PROBE_TIMEOUT_S = 1.5
"""Name lookup + TCP connect together; offline machines answer in ms or hang, so this bounds both."""


def cifar10_missing_message(root: Path, reason: str, tried_download: bool) -> str:
    """The one line for a missing CIFAR-10, shared by the worker (torchlaunch.worker.data) and the launchers."""
    first_fix = "run once with internet access" if tried_download else "set data.download=true when online"
    return (
        f"data error: CIFAR-10 not found under {root / CIFAR_FOLDER} ({reason}): {first_fix}, "
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
    if (root / CIFAR_FOLDER / "test_batch").is_file():
        return
    if not cfg.download:
        raise BadInput(cifar10_missing_message(root, "download is off", False))
    if probe:
        host, port = probe_target()
        reason = unreachable_reason(host, port)
        if reason is not None:
            raise BadInput(cifar10_missing_message(root, f"download host unreachable: {reason}", True))


def check_cifar10_data(cfg: DataConfig, local: bool) -> None:
    """The registry's pre-check of data.name=cifar10: the download host is probed only when local."""
    check_cifar10(cfg, probe=local)


@dataclass
class Cifar10Options:
    """cifar10's own keys."""

    download: bool = False
    """cifar10 only: download the batches into `root` when missing (needs internet)."""


register(
    DataFormat(
        name="cifar10",
        summary="torchvision's CIFAR-10 python batches",
        load=lazy("torchlaunch.worker.data.cifar10:load_cifar10"),
        precheck=check_cifar10_data,
        eval_set=lazy("torchlaunch.worker.data.cifar10:cifar10_eval_set"),
        detect=lambda root: (root / CIFAR_FOLDER).is_dir(),
        held_out=("all", "val"),
        options=Cifar10Options,
    )
)
