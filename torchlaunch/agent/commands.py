"""What a node runs, as pure functions of the job (no environment, no files): torchrun's command, the
single worker's, or the live agent's, and the rendezvous id every node of one job computes alike.

Why apart from the run: these are what --dry-run prints, what a backend's render shows and what the
golden files pin, so they must stay free of anything that starts, waits or reads the machine.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from torchlaunch import runner as program_mod
from torchlaunch.agent import first_group
from torchlaunch.launch import cli, elastic, emit, rdzv_file, shape
from torchlaunch.launch.spec import JobSpec

BUILTIN_WORKER = program_mod.BUILTIN_WORKER  # the default program; never the top-level `train` a user may own


PREFLIGHT = program_mod.PREFLIGHT


@dataclass(frozen=True)
class NodePlacement:
    """Where this node sits in a multi-node job (ignored for a single node)."""

    node_rank: int = 0
    master_addr: str | None = None
    rdzv_conf: tuple[tuple[str, int], ...] = ()
    """Elastic jobs: torchrun's rendezvous timeouts (launch.elastic.parse_rdzv_conf)."""
    incarnation: str = ""
    """A rendezvous in the run dir: the job's incarnation (runlock.Holder.incarnation), once the lock is held."""


def run_id(run_dir: str) -> str:
    """Stable rendezvous id: every node of the same run computes the same one."""
    return "tl-" + hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]


def program_id(program: Sequence[str], placement: NodePlacement, port: int) -> str:
    """Rendezvous id of a user's program: every node runs the same command line, so computes the same."""
    text = "\0".join([*program, placement.master_addr or "", str(port)])
    return "tl-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def rendezvous_id(spec: JobSpec, placement: NodePlacement) -> str:
    """Every node of one job computes the same id: from the run dir for the built-in worker, from the
    program and its placement for a user's program (and its run dir, where the nodes meet there)."""
    if meets_in_run_dir(spec):
        text = "\0".join([*spec.program, os.path.abspath(spec.run_dir or "")])
        return "tl-" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return program_id(spec.program, placement, spec.master_port) if spec.program else run_id(spec.run_dir or "")


def meets_in_run_dir(spec: JobSpec) -> bool:
    """A user's program on a node range with a --run-dir: its nodes rendezvous in the run dir
    (launch.rdzv_file), so losing any node, the first included, costs one restart, not the job. The
    built-in worker across nodes trains live; without a run dir, torchrun's c10d store at --master-addr."""
    return bool(spec.program) and spec.min_nodes is not None and bool(spec.run_dir)


def program_tail(spec: JobSpec, module: str) -> list[str]:
    """What each rank runs, always through the one runner: the user's program, or the built-in
    `module` (the worker, or the pre-flight of --doctor) on the resolved config."""
    if spec.program and module == BUILTIN_WORKER:
        return ["-m", "torchlaunch.runner", *emit.argv_items(spec.program, "program argument")]
    return [
        "-m",
        "torchlaunch.runner",
        "-m",
        module,
        "--config",
        emit.argv_item(not_an_option(spec.config), "--config"),
        *emit.argv_items(spec.overrides, "override"),
    ]


def not_an_option(path: str) -> str:
    """A relative path that starts with `-` (run_dir=-run) as `./-run`: never read as an option."""
    return f"./{path}" if path.startswith("-") else path


MASTER_ADDR_REQUIRED = "--master-addr is required with --nnodes > 1 (pass the host name or address of node 0)"
"""Both roads: the restart road's rendezvous and the live road's first group meet at node 0's address."""


def torchrun_argv(
    spec: JobSpec,
    placement: NodePlacement,
    *,
    python: str = "python",
    module: str = BUILTIN_WORKER,
    rdzv_run_id: str | None = None,
) -> list[str]:
    """The exact torchrun command for one node of `spec` (pure: no environment, no files).
    launch.torchrun is torchrun minus its ~0.8 s interpreter teardown at exit."""
    argv = [
        python,
        "-m",
        "torchlaunch.launch.torchrun",
        "--nnodes",
        str(spec.nodes),
        "--nproc-per-node",
        str(spec.gpus_per_node),
        "--max-restarts",
        str(spec.max_restarts),
    ]
    if spec.min_nodes is not None and meets_in_run_dir(spec):
        argv[argv.index("--nnodes") + 1] = shape.NodeRange(spec.min_nodes, spec.nodes).torchrun()
        argv += rdzv_file.torchrun_options(
            spec.run_dir or "", rdzv_run_id or "torchlaunch", placement.rdzv_conf, placement.incarnation
        )
    elif spec.min_nodes is not None:
        if placement.master_addr is None:
            raise cli.error("--master-addr is required with --nnodes MIN:MAX (the host of the rendezvous store)")
        argv[argv.index("--nnodes") + 1] = shape.NodeRange(spec.min_nodes, spec.nodes).torchrun()
        argv += elastic.torchrun_rendezvous(
            shape.NodeRange(spec.min_nodes, spec.nodes),
            placement.master_addr,
            spec.master_port,
            rdzv_run_id or "torchlaunch",
            placement.rdzv_conf,
        )
    elif spec.nodes == 1 and placement.master_addr is None:
        argv.append("--standalone")  # private rendezvous on a free local port
    else:
        if placement.master_addr is None:
            raise cli.error(MASTER_ADDR_REQUIRED)
        is_host = "true" if placement.node_rank == 0 else "false"
        argv += [
            "--node-rank",
            str(placement.node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{placement.master_addr}:{spec.master_port}",
            "--rdzv-id",
            rdzv_run_id or "torchlaunch",
            "--rdzv-conf",
            f"is_host={is_host}",
        ]
    argv += program_tail(spec, module)
    return argv


def runs_without_agent(spec: JobSpec, placement: NodePlacement) -> bool:
    """One worker on one node with no restarts: torchrun's agent would only start it (its own torch
    import alone costs ~1.7 s on 2 cores), so the worker runs directly, with torchrun's env contract set
    by this launcher (single_worker_env); a one-rank contract builds no process group (core.dist)."""
    return (
        spec.nodes == 1
        and spec.min_nodes is None
        and spec.gpus_per_node == 1
        and spec.max_restarts == 0
        and placement.master_addr is None
    )


def uses_agent(spec: JobSpec, placement: NodePlacement, doctor: bool) -> bool:
    return doctor or not runs_without_agent(spec, placement)


def worker_argv(spec: JobSpec, *, python: str = "python", module: str = BUILTIN_WORKER) -> list[str]:
    """The single worker's command when it runs without the agent (pure)."""
    return [python, *program_tail(spec, module)]


def launch_argv(spec: JobSpec, placement: NodePlacement, module: str, doctor: bool, rdzv_run_id: str) -> list[str]:
    """The command this launcher runs: the single worker itself when no agent is needed (never for the
    distributed pre-flight), else torchrun."""
    if runs_without_agent(spec, placement) and not doctor:
        return worker_argv(spec, python=sys.executable, module=module)
    return torchrun_argv(spec, placement, python=sys.executable, module=module, rdzv_run_id=rdzv_run_id)


def render(spec: JobSpec, placement: NodePlacement, module: str = BUILTIN_WORKER, doctor: bool = False) -> list[str]:
    """The node's command for `spec` (pure: the --dry-run line, schedulers.local's render)."""
    return launch_argv(spec, placement, module, doctor, rendezvous_id(spec, placement))


def live_argv(
    spec: JobSpec,
    heartbeat_timeout_s: float,
    rdzv_run_id: str,
    *,
    python: str = "python",
    rejoin: int = 0,
    placement: NodePlacement | None = None,
    lighthouse: str = "",
    join_attempt: int = 0,
    first: first_group.FirstSeat | None = None,
) -> list[str]:
    """The live agent's command (torchlaunch.agent.live), pure: this node's ranks, which regroup
    in place when one is lost, and on one node the membership service beside them; across nodes, where
    node 0 is (the first group's store) and the service apart (`lighthouse`), and for a node that
    replaces a lost one, the attempt its ranks join the training group with (replaces_a_lost_node).
    With --nnodes MIN:MAX, the range (MIN goes to the ranks) and, once the nodes met (`first`), this
    node's seat in the first group, whose store is on its first node; without it (--dry-run: nobody
    met) the agent starts a first group of every node."""
    placement = placement or NodePlacement()
    across = ["--lighthouse", lighthouse] if lighthouse else []
    if not lighthouse and (spec.nodes > 1 or placement.master_addr is not None):
        across = ["--run-dir", spec.run_dir or ""]  # the agents place the service (live/placement.py)
    if join_attempt:
        across += ["--join-attempt", str(join_attempt)]
    if spec.nodes > 1 or placement.master_addr is not None:
        nodes = shape.NodeRange(spec.min_nodes or spec.nodes, spec.nodes)
        across += [
            "--nnodes",
            nodes.torchrun(),
            "--node-rank",
            str(placement.node_rank),
            "--master-addr",
            first.master_host if first is not None else placement.master_addr or "127.0.0.1",
            "--master-port",
            str(spec.master_port),
        ]
        if first is not None and not join_attempt:
            across += ["--first-seat", str(first.seat), "--first-nodes", str(first.nodes)]
    return [
        python,
        "-m",
        "torchlaunch.agent.live",
        "--nproc",
        str(spec.gpus_per_node),
        "--heartbeat-timeout-ms",
        str(round(heartbeat_timeout_s * 1000)),
        "--run-id",
        rdzv_run_id,
        "--rejoin",
        str(rejoin),
        *across,
        "--",
        *program_tail(spec, BUILTIN_WORKER),
    ]
