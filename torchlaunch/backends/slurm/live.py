"""Live recovery on Slurm (recovery.live=true): one owner for what it takes.

    python -m launch.slurm --nodes 2 --gpus-per-node 8 --config configs/cifar10.yaml recovery.live=true

The membership service is placed on one of the job's nodes by the run dir's lease (agent/placed.py,
live/placement.py): on each node the task of local rank 0 (SLURM_LOCALID 0) runs the node's
agent in a thread (a standby Lighthouse, the lease), which dies with the task; node 0 (SLURM_NODEID)
takes the first lease, another node's agent takes over when it lapses. `recovery.lighthouse=URL` names
a service of the user's own instead.

What Slurm must be told, the env each task adds, and the job's outcome. Measured on the dev cluster
(Slurm 22.05, docs/SLURM.md "Live recovery"):

- A task killed by a signal ends nothing else by itself (KillOnBadExit defaults to 0), but a cluster
  may set KillOnBadExit=1: `srun --kill-on-bad-exit=0` keeps the other tasks whatever slurm.conf says.
- When slurmctld takes the node for failed (DOWN), it ends the whole job (NODE_FAIL) unless both
  `sbatch --no-kill` and `srun --no-kill` are given: with sbatch's alone the step is still killed, with
  srun's alone the job is. With both, the node is removed from the job and the other tasks train on.
- The batch script runs on the first node: losing that node ends the job (the batch step is killed,
  FAILED, not requeued, even with --requeue), whatever the ranks could do. Training survives the loss
  of any other node in place; the first node's loss is taken over by a successor job that waited behind
  this one (afternotok) and resumes from the newest checkpoint (backends.slurm.successor; the batch lines
  below call its `start` before srun and `end` after).
- srun exits 137 once any task was SIGKILLed, and the batch script's code is the job's: Slurm would say
  FAILED although the survivors finished. So the script passes srun's code through `verdict` below,
  which reads what every task recorded (task.write_result) and decides as the live agent does
  (agent/live_shared.job_code, as the local live agent): tasks that left no record were lost; the others' codes are the job's.
- `--nodes MIN-MAX`: the allocation is as many nodes as are up in the range (render.elastic_parameters),
  so the verdict counts the tasks at run time (SLURM_NNODES x tasks per node), and each task passes MIN
  to its rank (minimum_env). A loss that leaves fewer than MIN nodes' worth of ranks makes them commit a
  checkpoint and exit 75 (live/minimum.py owns that rule), which rank 0 requeues as it does a
  preemption (task.SlurmTask._requeue); the next allocation of MIN..MAX nodes resumes from it.

What is not here: the local agent's pulse fencing of a frozen rank (no agent in a Slurm task). The
ranks judge a silent peer themselves (live/peers.py: an echo on each store's port while
training stalls), which covers a frozen process and a frozen or cut-off node alike.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from torchlaunch import contract, roads, rundir
from torchlaunch.agent import live_shared
from torchlaunch.base import files
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BadInput

LIVE = roads.get("live")
"""The live road (torchlaunch.roads): whether a job takes it, and its placement's start-up bound."""

PLACED = "placed"
"""SlurmOptions.lighthouse / SlurmTask.lighthouse of a live job whose nodes place the service themselves
(no URL: recovery.lighthouse is an http:// address)."""
SRUN_ARGS = ("--no-kill", "--kill-on-bad-exit=0")
"""srun's side: a lost task or node ends neither the step nor the other tasks (see the module doc)."""
STEP_FUNCTION = "srun_forwarding_stops"
"""The batch script's stop-forwarding wrapper of srun (render.batch_shell_stop), under this name in live
mode: the script's `srun` is then the verdict wrapper around it."""
LOST = -9
"""A task that left no outcome record: lost (SIGKILLed with its node), as the live agent sees a signal."""


def lighthouse_of(
    live: str | bool, lighthouse: str, rejoin: int, *, nodes: int, ranks_per_node: int, image: bool
) -> str:
    """The membership service's address when this Slurm job runs live (PLACED: its nodes place it
    through the run dir, without recovery.lighthouse), '' when it does not (pure).

    Bad input, one line: recovery.rejoin (no agent on the node to start a lost task again), an explicit
    recovery.live=true with a container image (the batch script's verdict runs on the host, outside the
    image: not built yet); under auto (the default) an image takes the requeue road (IMAGE_WHY). One
    rank in all has nobody to regroup with. A node range is live too: its MIN reaches the ranks
    (minimum_env), below which they stop for a requeue."""
    if live is False:
        return ""
    if rejoin:
        raise BadInput(
            f"recovery.rejoin={rejoin} needs the local live agent (it starts a lost rank again); a Slurm task "
            "is not started again: set recovery.rejoin=0"
        )
    if image and LIVE.insisted(live):
        raise BadInput("recovery.live=true with --image is not built yet: run without --image, or recovery.live=false")
    return (lighthouse or PLACED) if LIVE.takes(live, not image and nodes * ranks_per_node > 1) else ""


IMAGE_WHY = "--image: live mode's batch script is not built for a container yet"
"""Why a multi-rank Slurm job of the built-in worker with --image takes the requeue road under auto."""


def road_line(live: bool, why: str = roads.RESTART.WAY_OUT) -> str:
    """The one line that says which road a multi-rank Slurm run takes; `why` a requeue (the way out,
    IMAGE_WHY, or a user's program: PROGRAM_WHY)."""
    if live:
        return (
            "launch: road: live (a lost node costs a regroup in place, the batch host's a successor job that "
            "resumes; recovery.live=false: the requeue)"
        )
    return (
        f"launch: road: requeue ({why}): a lost node ends the allocation; the job resumes from the "
        "newest checkpoint when requeued or submitted again"
    )


def minimum_env(min_nodes: int | None, max_nodes: int) -> dict[str, str]:
    """What a live job on `--nodes MIN-MAX` tells its ranks (pure): MIN, and the range in the user's
    words. A group that a loss leaves with fewer than MIN nodes' worth of ranks checkpoints and exits 75,
    which the task requeues like a preemption (live/minimum.py owns the rule). Nothing for a
    fixed --nodes N: its group trains on down to one rank."""
    if min_nodes is None:
        return {}
    return {contract.LIVE_MIN_NODES: str(min_nodes), contract.LIVE_NODE_RANGE: f"--nodes {min_nodes}-{max_nodes}"}


def batch_lines(python: str, run_dir: str, tasks_per_node: int) -> list[str]:
    """The batch script's `srun` in live mode: the stop-forwarding wrapper, then `verdict` on a non-zero
    code, whose exit code (the survivors' outcome) becomes the job's. The tasks are counted at run time
    (tasks per node x the allocation's nodes): with --nodes MIN-MAX only Slurm knows how many there are.
    Around it, the first node's recovery (backends.slurm.successor): before srun, `start` (a successor job
    waits behind this one; a successor whose predecessor was not lost ends here with 0), after it, `end`
    (the code recorded, the successor cancelled unless the job was requeued)."""
    from torchlaunch.backends.slurm import successor
    from torchlaunch.launch import emit

    py = emit.shell_word(python, "--python")
    where = emit.shell_word(run_dir, "the run dir")
    verdict = " ".join(
        [py, "-m", __name__, "--run-dir", where, "--ranks-per-node", str(tasks_per_node), '--srun-code "$code"']
    )
    chain = f"{py} -m {successor.__name__} --run-dir {where}"
    return [
        "# Live recovery: a lost node's task must not end the job; the job's code is the survivors' outcome.",
        f'srun() {{ {STEP_FUNCTION} "$@"; local code=$?; [ "$code" -eq 0 ] || {{ {verdict}; code=$?; }}; '
        f'{chain} end --code "$code"; return "$code"; }}',
        "# The first node's loss: a successor job waits behind this one (afternotok) and resumes the run if this",
        "# batch host is lost; a successor whose predecessor was not lost ends here, with 0.",
        f'{chain} start --script "$0"; [ "$?" -ne {successor.NOTHING_TO_RESUME} ] || exit 0',
    ]


def task_env(
    lighthouse: str, store_host: str, minimum: dict[str, str] | None = None, placed: bool = False
) -> dict[str, str]:
    """What a live rank needs beyond torchrun's contract (submitit exported that): the service's
    address, the address the other nodes reach this node's stores on, a node range's minimum
    (minimum_env), and for a placed service the word to follow it in the run dir when it moves."""
    follow = {contract.LIVE_PLACED: "1"} if placed else {}
    return {contract.LIGHTHOUSE: lighthouse, contract.LIVE_STORE_HOST: store_host, **(minimum or {}), **follow}


def place_service(
    run_dir: str, heartbeat_timeout_ms: int, local_rank: int, nproc: int, host: str
) -> tuple[str, Callable[[], None]]:
    """In a task of a live job with the service PLACED: its address, and what ends this task's part.
    Local rank 0 runs its node's agent (agent/placed.py) in a daemon thread, so that it ends with
    the task whatever ends it (the standby Lighthouse sees its pipe close); the node's other tasks
    read the lease. Node number and count from Slurm (SLURM_NODEID, SLURM_NNODES): none is asked for."""
    import threading

    from torchlaunch.agent import placed as agent

    if local_rank != 0:
        bound = LIVE.placement.SERVICE_START_S + 2 * heartbeat_timeout_ms / 1000
        return agent.await_service(run_dir, bound), lambda: None
    node = whole(contract.get(contract.SLURM_NODEID, "0") or "0", 6) or 0
    nodes = whole(contract.get(contract.SLURM_NNODES, "1") or "1", 6) or 1
    here = agent.Placed.start(run_dir, heartbeat_timeout_ms, node, nodes, nproc, host)
    try:
        address = here.wait_for_service()
    except BaseException:
        here.close()
        raise
    done = threading.Event()
    thread = threading.Thread(target=here.keep, args=(done,), name="torchlaunch-placed-service", daemon=True)
    thread.start()

    def end() -> None:
        done.set()
        thread.join(timeout=10)

    return address, end


def node_store_host(lighthouse: str, nnodes: int, master_addr: str) -> str:
    """This node's address toward the service, as the live agent finds it (live_shared.store_host)."""
    return live_shared.store_host(nnodes, master_addr, lighthouse)


def job_code(srun_code: int, codes: Sequence[int | None]) -> int:
    """The job's exit code from srun's and each task's recorded code (None: the task left no record of
    this allocation, so it was lost) (pure). No record at all: srun's code stands (nothing ran to the
    end, e.g. a start-up failure). Else the live agent's rule: every survivor 0 -> 0; a survivor's own
    bad input, failure or preemption -> that code."""
    if all(code is None for code in codes):
        return srun_code
    return live_shared.job_code([LOST if code is None else code for code in codes])


def recorded_codes(folder: Path, job_id: str, launch_id: str, tasks: int) -> list[int | None]:
    """Each task's code in this allocation (task.write_result's record); None where it left none, or
    where its group was fenced (left out: a node frozen or cut off past the bound while the others trained
    on; its exit 2 is not the job's bad input). A record of an earlier allocation of the job (before a
    requeue) does not count."""
    from torchlaunch.backends.slurm.result import result_path

    codes: list[int | None] = []
    for task in range(tasks):
        data, _ = files.read_json(result_path(folder, job_id, task))
        same = data is not None and data.get("launch") == launch_id and data.get("left_out") is not True
        codes.append(files.as_int(data.get("code"), 0, 255) if same and data is not None else None)
    return codes


def task_count(tasks_per_node: int, nnodes: str) -> int:
    """The allocation's tasks: its nodes (SLURM_NNODES in the batch script, fixed when it started) x the
    tasks per node (pure). 0 when the count is unreadable: srun's own code then stands (job_code)."""
    nodes = whole(nnodes.strip(), 6)
    return tasks_per_node * nodes if nodes is not None else 0


def verdict(argv: Sequence[str] | None = None) -> int:
    """`python -m torchlaunch.backends.slurm.live --run-dir R --ranks-per-node K --srun-code C` in the
    batch script after srun: the job's code, with one line saying which tasks were lost."""
    parser = argparse.ArgumentParser(prog="python -m torchlaunch.backends.slurm.live")
    parser.add_argument("--run-dir", required=True)
    count = parser.add_mutually_exclusive_group(required=True)
    count.add_argument("--ranks-per-node", type=int)
    count.add_argument("--tasks", type=int, help="a fixed task count: the batch scripts of jobs submitted before")
    parser.add_argument("--srun-code", type=int, required=True)
    args = parser.parse_args(argv)
    job_id = contract.get(contract.SLURM_JOB_ID, "") or ""
    launch_id = f"{job_id}-{contract.get(contract.SLURM_RESTART_COUNT) or 0}"
    nnodes = contract.get(contract.SLURM_NNODES, "") or ""
    tasks = args.tasks if args.tasks is not None else task_count(args.ranks_per_node, nnodes)
    codes = recorded_codes(rundir.slurm(args.run_dir) / job_id, job_id, launch_id, tasks)
    code = job_code(args.srun_code, codes)
    lost = [str(task) for task, c in enumerate(codes) if c is None]
    if lost and len(lost) < len(codes):
        outcome = "the others finished" if code == 0 else f"exit {code}"
        print(
            f"live: srun exited {args.srun_code}; task(s) {', '.join(lost)} lost (no outcome recorded, or left out "
            f"of the group that trained); {outcome}",
            flush=True,
        )
    return code


if __name__ == "__main__":
    sys.exit(verdict(sys.argv[1:]))
