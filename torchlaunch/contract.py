"""The launcher -> rank environment contract: its names and its only reader (torch-free).

Contract: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, set by torchrun,
submitit's TorchDistributedEnvironment or a Kubernetes pod's launch.local. When they are absent a rank
runs as a single process, so `python -m train` works on a laptop exactly as under a launcher.

Everything that needs to know who it is in the job (core.dist's process group, the runner's status
record, evaluate's "print once", the decode-cache prefetch, the pre-flight) asks here, so a launcher
quirk (an empty or malformed value) is handled once. Kept free of torch: the runner and the
launchers import it before any heavy import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torchlaunch.exit_codes import BadInput

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def read_env(env: Mapping[str, str] | None = None) -> dict[str, int | str] | None:
    """Parse the contract; None when no launcher set it. Half-set contracts are bad input."""
    env = os.environ if env is None else env
    present = [k for k in CONTRACT if k in env]
    if not present:
        return None
    if "RANK" in present and "WORLD_SIZE" in present and len(present) < len(CONTRACT):
        missing = [k for k in CONTRACT if k not in env and k not in ("LOCAL_WORLD_SIZE",)]
        if missing:
            raise BadInput(
                f"env error: {', '.join(missing)} not set while RANK/WORLD_SIZE are "
                "(start workers with a launcher: python -m launch.local, torchrun, submitit)"
            )
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    parsed: dict[str, int | str] = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        raw = env.get(key, "1" if key == "LOCAL_WORLD_SIZE" else "0")
        try:
            parsed[key] = int(raw)
        except ValueError:
            raise BadInput(f"env error: {key}={raw!r} is not an integer (fix the launcher's environment)") from None
    parsed["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
    if not 0 <= int(parsed["RANK"]) < int(parsed["WORLD_SIZE"]):
        raise BadInput(
            f"env error: RANK={parsed['RANK']} outside WORLD_SIZE={parsed['WORLD_SIZE']} "
            "(fix the launcher's environment)"
        )
    return parsed


def _lenient(key: str, env: Mapping[str, str] | None) -> int:
    """One contract integer where a wrong value must not stop anything (reporting, printing once):
    0 when unset, empty or malformed; read_env is where a malformed contract becomes bad input."""
    env = os.environ if env is None else env
    try:
        return int(env.get(key, "0") or 0)
    except ValueError:
        return 0


def rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank (0 alone)."""
    return _lenient("RANK", env)


def world_size(env: Mapping[str, str] | None = None) -> int:
    """The number of ranks of the job (0 when unset: no launcher)."""
    return _lenient("WORLD_SIZE", env)


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank on its machine (0 alone)."""
    return _lenient("LOCAL_RANK", env)


def is_main(env: Mapping[str, str] | None = None) -> bool:
    """True on global rank 0, the one that prints what every rank would say."""
    return rank(env) == 0
