"""Start this node's ranks and wait for them: their environment (the env contract, threads per rank,
the attempt), the child process (torchrun's agent, the single worker, or the live agent), and the
stop relay and watchdog around it.

Why the child is not exec'd: this process must outlive it to relay stops exactly once, watch for hangs,
and turn the ranks' reports into an exit code torchrun cannot give (outcome.py). The child dies with
this process, even by SIGKILL; torchrun's workers, in sessions of their own, die with torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from torchlaunch import contract, pdeath, rankpath, status
from torchlaunch.agent import outcome, stops, watch
from torchlaunch.agent.stops import FORWARDED_SIGNALS, StopRelay, own_group_dying_with, stop_env
from torchlaunch.exit_codes import PREEMPTED
from torchlaunch.jobs.launcher import Operation
from torchlaunch.launch.relay import StderrRelay
from torchlaunch.launch.spec import JobSpec

ATTEMPT_ENV = status.ATTEMPT_ENV


TORCHRUN_ENV = contract.TORCHRUN_ENV


def worker_threads(procs_per_node: int, cores: int) -> int:
    """OMP threads per worker so that workers x threads <= cores."""
    return max(1, cores // max(1, procs_per_node))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def launch_env(
    spec: JobSpec, base: dict[str, str], cores: int, attempt: str, status_folder: Path | None = None
) -> dict[str, str]:
    env = dict(base)
    if spec.program:
        # The runner must import from any working directory; only torchlaunch, never the project's
        # other folders (tests, bench, ...), which would shadow the user's packages of the same name.
        env["PYTHONPATH"] = rankpath.pythonpath(env.get("PYTHONPATH"))
    if status_folder is not None:
        env[status.STATUS_DIR_ENV] = str(status_folder)
    env.setdefault("OMP_NUM_THREADS", str(worker_threads(spec.gpus_per_node, cores)))
    # torch 2.14.1: restarts fail with stale addresses in a shared rendezvous store (pytorch#135712).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[ATTEMPT_ENV] = attempt
    return env


def free_port() -> int:
    """A port nobody listens on now, for the single worker's MASTER_PORT (torchrun --standalone picks one too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


single_worker_env = contract.single_worker_env


def contract_env(env: dict[str, str], agent: bool, rdzv_run_id: str) -> dict[str, str]:
    """The ranks' env contract: a stale one in the launcher's own environment never leaks into them;
    torchrun's agent sets it for its workers, this launcher for the single worker it starts itself."""
    clean = {k: v for k, v in env.items() if k not in TORCHRUN_ENV and k != pdeath.LAUNCHER_PID_ENV}
    if agent:
        return {**clean, **pdeath.launcher_env()}
    return {**clean, **single_worker_env(rdzv_run_id, free_port())}


def run(
    argv: list[str],
    env: dict[str, str],
    status_folder: Path,
    attempt: str,
    label: str = "training",
    ranks: int | None = None,
    *,
    op: Operation | None = None,
    agent: bool = True,
    run_dir: Path | None = None,
) -> int:
    """Run torchrun (or the single worker), forward stop signals to it, and turn the workers' reports
    into one exit code. The child dies with this process, even by SIGKILL; torchrun's workers, in
    sessions of their own, die with torchrun (pdeath.die_with_agent in each rank)."""
    env = {**env, status.STATUS_DIR_ENV: str(status_folder)}
    what = "torchrun" if agent else "worker"
    started = time.time()
    read_fd, write_fd = os.pipe()
    if sys.stderr.isatty():
        env = {**env, contract.PROGRESS_BAR: "1"}  # workers see a pipe, the user a terminal
    forwarded: list[int] = []
    children: list[subprocess.Popen] = []
    stop = StopRelay(forwarded, children)
    previous = {sig: signal.signal(sig, stop.receive) for sig in FORWARDED_SIGNALS}
    # Only now, with the relay in place, are earlier stops read: one that lands while the handlers are
    # swapped is in one list or the other, never in neither (a scheduler's stop just after the
    # launcher's first line was lost that way, and the run trained to the end).
    forwarded[:0] = stops.EARLY_SIGNALS
    if forwarded:  # stopped before anything started: nothing to save, nothing lost
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(read_fd)
        os.close(write_fd)
        name = signal.Signals(forwarded[0]).name
        print(
            f"launch: {name} before the {what} started: nothing to save (exit 75); run the same command again",
            file=sys.stderr,
        )
        return PREEMPTED
    env = {**stop_env(os.environ), **env}
    child = subprocess.Popen(argv, env=env, stderr=write_fd, preexec_fn=own_group_dying_with(pdeath.die_with_parent()))
    children.append(child)
    if forwarded:  # a signal between the check above and Popen: pass it on now
        stop.pass_on()
    os.close(write_fd)
    relay = StderrRelay(read_fd, sys.stderr)
    try:
        if op is not None:
            op.start(watch.on_hang(child, agent))
        child_code = child.wait()
    except BaseException:
        pdeath.kill_tree(child.pid)  # leaving early: nothing of this run may train on
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.finish()
    return outcome.report(
        child_code,
        status_folder,
        attempt,
        forwarded,
        interrupted=stop.interrupted,
        label=label,
        ranks=ranks,
        op=op,
        what=what,
        run_dir=run_dir,
        started=started,
        relay=relay,
    )
