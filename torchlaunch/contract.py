"""The environment a job runs in: every variable name (torchrun's, the schedulers', the project's
own TORCHLAUNCH_*) defined here once, and read here (torch-free).

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

from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BadInput

# ---- torchrun's contract (what every launcher gives every rank) --------------------------------------

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
CONTRACT = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""How many times torchrun's agent restarted the worker group in this launch (0 at the first start)."""
ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in every worker it starts: the sign that a rank's parent is that agent."""
TORCHRUN_ENV = (
    *CONTRACT,
    GROUP_RANK,
    GROUP_WORLD_SIZE,
    ROLE_RANK,
    ROLE_NAME,
    ROLE_WORLD_SIZE,
    ELASTIC_RUN_ID,
    RESTART_COUNT,
    MAX_RESTARTS,
    USE_AGENT_STORE,
    ERROR_FILE,
)
"""What torchrun's agent sets in every worker (local_elastic_agent._start_workers): never inherited."""


def single_worker_env(rdzv_run_id: str, port: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's env contract for one worker on one node, for a launcher that starts it without an
    agent: the same names and values torchrun's agent gives its only worker (so `init_process_group
    ("env://")` and a framework's own environment detection work), except USE_AGENT_STORE=False since
    no agent hosts a store: rank 0 hosts it at MASTER_PORT."""
    env = os.environ if env is None else env
    return {
        RANK: "0",
        LOCAL_RANK: "0",
        WORLD_SIZE: "1",
        LOCAL_WORLD_SIZE: "1",
        GROUP_RANK: "0",
        GROUP_WORLD_SIZE: "1",
        ROLE_RANK: "0",
        ROLE_NAME: "default",
        ROLE_WORLD_SIZE: "1",
        MASTER_ADDR: "localhost",
        MASTER_PORT: str(port),
        ELASTIC_RUN_ID: rdzv_run_id,
        RESTART_COUNT: "0",
        MAX_RESTARTS: "0",
        USE_AGENT_STORE: "False",
        NCCL_ASYNC_ERROR_HANDLING: env.get(NCCL_ASYNC_ERROR_HANDLING, "1"),
    }


# ---- the schedulers' own ------------------------------------------------------------------------------

SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_ARRAY_JOB_ID = "SLURM_ARRAY_JOB_ID"
SLURM_ARRAY_TASK_ID = "SLURM_ARRAY_TASK_ID"
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
SLURM_NODEID = "SLURM_NODEID"
SLURM_NNODES = "SLURM_NNODES"
SLURM_CPUS_PER_TASK = "SLURM_CPUS_PER_TASK"
KUBERNETES_SERVICE_HOST = "KUBERNETES_SERVICE_HOST"
"""Set in every pod: with K8S_JOB, the sign that a launcher runs in a Kubernetes Job's pod."""
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
"""An Indexed Job pod's index: its node rank."""

# ---- the project's own: launcher -> rank (and pod manifest -> launcher) ------------------------------

ATTEMPT_ID = "TORCHLAUNCH_ATTEMPT_ID"
"""Set by the launcher: the id of this launch. Status records and heartbeats of other launches are old."""
STATUS_DIR = "TORCHLAUNCH_STATUS_DIR"
"""Set by the launcher: where the ranks of this node leave their outcome records (torchlaunch.status)."""
PROGRESS_DIR = "TORCHLAUNCH_PROGRESS_DIR"
"""Set by the launcher to RUN_DIR/progress: where each rank leaves its heartbeat."""
LOGS_DIR = "TORCHLAUNCH_LOGS_DIR"
"""Set by the launcher to RUN_DIR/logs: each rank tees its output into rank-N.log there."""
LAUNCH_TOKEN = "TORCHLAUNCH_LAUNCH_TOKEN"
"""Set by the launcher in its children's environment: the secret behind the job record's digest."""
LAUNCHER_PID = "TORCHLAUNCH_LAUNCHER_PID"
"""Set by the launcher for torchrun (and so for its workers): the agent's expected parent."""
RANK_PREFIX = "TORCHLAUNCH_RANK_PREFIX"
"""Set to 1 by the launcher: every console line of a rank starts with `[rank N] `."""
CONSOLE_RANKS = "TORCHLAUNCH_CONSOLE_RANKS"
"""Set by the launcher to the ranks whose output reaches the console (`0,3`, or empty for none)."""
PROGRESS_BAR = "TORCHLAUNCH_PROGRESS_BAR"
"""Set to 1 by the launcher when its own stderr is a terminal: the workers see a pipe, the user a terminal."""
LIGHTHOUSE = "TORCHLAUNCH_LIGHTHOUSE"
"""Set by a live-mode launcher (recovery.live): the membership service's address, http://HOST:PORT."""
LIVE_PLACED = "TORCHLAUNCH_LIVE_PLACED"
"""Set to 1 by a live agent across nodes that places the service itself (live/placement.py): the
service may move to another node, whose address the rank reads in the run dir when it stops answering."""
LIVE_JOIN = "TORCHLAUNCH_LIVE_JOIN"
"""Set by the live agent on a rank it started again (recovery.rejoin): the attempt, from 1. The rank
forms no group at start; it joins the live group and takes its state from a peer."""
LIVE_STORE_HOST = "TORCHLAUNCH_LIVE_STORE_HOST"
"""Set by the live agent: the address the other nodes reach this node on; a rank's store is given out
there (loopback on one node)."""
LIVE_PULSE_FD = "TORCHLAUNCH_LIVE_PULSE_FD"
"""Set by the live agent: the file descriptor of the pipe the rank beats down (live/pulse.py)."""
LIVE_MIN_NODES = "TORCHLAUNCH_LIVE_MIN_NODES"
"""Set by a launcher given a node range (Slurm's --nodes MIN-MAX): MIN. A live group left with fewer than
MIN nodes' worth of ranks checkpoints and exits 75 for a requeue (live/minimum.py)."""
LIVE_NODE_RANGE = "TORCHLAUNCH_LIVE_NODE_RANGE"
"""Set with LIVE_MIN_NODES: the range as the user gave it (`--nodes 2-3`), quoted in the rank's line."""
LIVE_PRESENCE_KEY = "TORCHLAUNCH_LIVE_PRESENCE_KEY"
"""Set by the live agent that runs the membership service itself (one node): 64 hex digits, made per
launch, in the environment of the service and of the ranks only (which only their owner can read): a
rank's presence hello proves it (live/presence.py), a stranger's cannot."""
LIVE_FIRST_GROUP = "TORCHLAUNCH_LIVE_FIRST_GROUP"
"""Set by the live agent of a `launch.local --nnodes MIN:MAX` launch: `R/W`, this rank's place in the
first group (the nodes that came in time), which its process group is formed as; RANK and WORLD_SIZE
stay the launch's (node rank x ranks per node + local rank, of MAX nodes), which name its files and its
replica id. Always set there, so that a first group of one rank is formed too (later nodes join it)."""
GRACE = "TORCHLAUNCH_GRACE_S"
"""Seconds between a stop signal and the platform's SIGKILL, where the platform states it (the pods
launch.k8s renders); launch.local passes the figure it used on to its ranks (torchlaunch.grace)."""
K8S_JOB = "TORCHLAUNCH_K8S_JOB"
K8S_NAMESPACE = "TORCHLAUNCH_K8S_NAMESPACE"
"""Set in the pod by the Job manifest (downward API: the job-name label and metadata.namespace)."""

# ---- test and fault-injection aids (documented in docs/testing.md) ----------------------

DOWNLOAD_PROBE = "TORCHLAUNCH_DOWNLOAD_PROBE"
"""HOST:PORT probed instead of the download host (tests point it at loopback)."""
FAULT_SIGNAL = "TORCHLAUNCH_FAULT_SIGNAL"
"""`at=step|val|save,n=N[,rank=R][,sig=SIGTERM]`: rank R sends itself a signal there (torchlaunch.worker.faults)."""
FAULT_SAVE_STALL_S = "TORCHLAUNCH_FAULT_SAVE_STALL_S"
FAULT_SAVE_STALL_FROM_STEP = "TORCHLAUNCH_FAULT_SAVE_STALL_FROM_STEP"
"""A checkpoint save stalls this long before its commit, from this step on (torchlaunch.core.checkpoint.store)."""


def get(name: str, default: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The value of the contract variable `name` (one of the names above), else `default`: every read
    of the job's environment outside this module goes through here, so a name cannot drift."""
    env = os.environ if env is None else env
    return env.get(name, default)


def require(name: str, env: Mapping[str, str] | None = None) -> str:
    """The value of `name`, which the caller's scheduler always sets (KeyError where it did not)."""
    env = os.environ if env is None else env
    return env[name]


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """torchrun's restarts of the worker group in this launch (0 at the first start or without torchrun)."""
    return _lenient(RESTART_COUNT, env)


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


def live_first_group(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, world size) of this rank's first live group (LIVE_FIRST_GROUP), or None when unset; a
    value that is not `R/W` with 0 <= R < W is bad input, one line."""
    raw = get(LIVE_FIRST_GROUP, "", env) or ""
    if not raw:
        return None
    rank, slash, world = raw.partition("/")
    seat, size = whole(rank, 7), whole(world, 7)
    if not (slash and seat is not None and size is not None and seat < size):
        raise BadInput(f"env error: {LIVE_FIRST_GROUP}={raw[:20]!r} is not RANK/WORLD with RANK < WORLD")
    return seat, size


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
