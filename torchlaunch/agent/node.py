"""The node agent: one per node, it runs the node's ranks and reports their outcome. `python -m
launch.local` runs it on this host; each Kubernetes pod runs it too (`python -m torchlaunch.agent`).

    python -m launch.local --gpus 4 --config configs/cifar10.yaml optim.lr=0.2
    python -m launch.local --nnodes 2 --node-rank 1 --master-addr node0 --gpus 8 --config ...
    python -m launch.local --nnodes 1:2 --master-addr node0 --config ...  # live (the default): the first
        # group of the nodes in time (first_group.py); with recovery.live=false, torchrun's elastic restart
    python -m launch.local --gpus 2 -- my_train.py --epochs 3     # any script: the default program
    python -m launch.local --nnodes 1:2 --run-dir /shared/r --max-restarts 3 -- my_train.py  # meets in the run dir
    python -m launch.local --gpus 2 -- -m my_pkg.train --lr 0.1   # is the built-in worker (-m torchlaunch.worker)

Every rank runs through torchlaunch.runner, the built-in worker (`-m torchlaunch.worker`, the default
program) exactly like a user's script, so both get the same env contract, signal forwarding, torchrun
restarts, exit codes 0/2/75/1, --dry-run and --doctor. The argv grammar, the program rule and the
pre-spawn policy are torchlaunch.launch.cli's. A user's ranks report to a private status folder
instead of RUN_DIR/status, since the launcher knows no run dir of a user's program. One worker without
restarts runs directly, without torchrun's agent (commands.runs_without_agent).

This module is the order of a launch: plan (options.py), take the run dir (runlock), settle the config,
decide live mode's start (live_start.py), then run the ranks (ranks.py). torchrun's and accelerate's
option spellings are accepted (torchlaunch.launch.cli.ALIASES).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from torchlaunch import config as config_mod
from torchlaunch import roads, rundir, runlock
from torchlaunch.agent import lighthouse_reach
from torchlaunch.agent.commands import (
    BUILTIN_WORKER,
    PREFLIGHT,
    NodePlacement,
    live_argv,
    meets_in_run_dir,
    render,
    rendezvous_id,
    uses_agent,
)
from torchlaunch.agent.live_start import (
    check_first_group,
    live_mode,
    live_options,
    live_start,
    numbered,
    require_live_extra,
)
from torchlaunch.agent.options import Plan, meets_at_node_0_first, parse_args, plan
from torchlaunch.agent.outcome import LaunchEnded
from torchlaunch.agent.ranks import available_cores, contract_env, launch_env, run
from torchlaunch.agent.stops import FORWARDED_SIGNALS, note_early_signal
from torchlaunch.exit_codes import BAD_INPUT, OK
from torchlaunch.jobs import record
from torchlaunch.jobs.launcher import Operation
from torchlaunch.launch import cli, elastic, finished, rdzv_file
from torchlaunch.launch.spec import JobSpec


def main(argv: Sequence[str] | None = None) -> int:
    previous = {sig: signal.signal(sig, note_early_signal) for sig in FORWARDED_SIGNALS}
    try:
        return cli.main(lambda: launch(sys.argv[1:] if argv is None else argv))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(argv: Sequence[str]) -> int:
    """Parse, plan, then print (--dry-run) or run the node's ranks; BadInput before anything starts."""
    args = parse_args(argv)
    try:
        planned = plan(args)
    except LaunchEnded as ended:  # --master-wait-s ran out (exit 1) or a stop came while it waited (75)
        print(f"launch: {ended.line}", file=sys.stderr, flush=True)
        return ended.code
    if planned.program is not None:
        return launch_program(args, planned)
    cfg, spec = planned.cfg, planned.spec
    assert cfg is not None
    module = PREFLIGHT if args.doctor else BUILTIN_WORKER
    rdzv = rendezvous_id(spec, planned.placement)
    live = live_mode(cfg, spec, planned.placement, args.doctor)
    if live:
        require_live_extra()
        if cfg.recovery.lighthouse and not args.dry_run:  # one bounded look, not a traceback per rank
            lighthouse_reach.check(cfg.recovery.lighthouse)
    if args.dry_run:
        if not args.doctor:  # the refusal a launch would make, nothing written
            config_mod.settle_resolved(cfg, reconfigure=args.reconfigure, write=False)
        typed = as_typed(spec, args)
        shown = (
            live_argv(typed, cfg.recovery.heartbeat_timeout_s, rdzv, **live_options(cfg, planned.placement))
            if live
            else render(typed, planned.placement, module, args.doctor)
        )
        print(shlex.join(shown))
        return OK
    argv_out = [] if live else render(spec, planned.placement, module, args.doctor)
    with owned(cfg.run_dir, planned.placement, elastic_job(spec, planned.placement, rdzv, live)) as lock:
        if meets_at_node_0_first(args, cfg):
            try:
                check_first_group(args, lock, cfg.run_dir)
            except LaunchEnded as ended:  # as above: nothing settled, nothing recorded
                print(f"launch: {ended.line}", file=sys.stderr, flush=True)
                return ended.code
        if args.doctor:  # checks this launch's config; the run's own is never rewritten by a pre-flight
            settled = config_mod.Settled(config_mod.write_resolved(cfg, rundir.doctor_config(cfg.run_dir)))
        else:
            settled = settle_config(cfg, args.reconfigure, lock)
        one_node = spec.nodes == 1 and spec.min_nodes is None and planned.placement.master_addr is None
        changed = args.doctor or settled.previous is not None or settled.note is not None
        if finished.already(cfg.run_dir, changed=changed, one_node=one_node):
            return OK  # torchlaunch.launch.finished: nothing started, nothing written
        if live:  # after the config is settled: a refused launch records nothing in RUN_DIR/live
            try:
                placement = numbered(args, planned.placement, lock)
                joins, first = live_start(lock, cfg, spec, placement)
            except LaunchEnded as ended:
                print(f"launch: {ended.line}", file=sys.stderr, flush=True)
                return ended.code
            options = live_options(cfg, placement)
            argv_out = live_argv(
                spec, cfg.recovery.heartbeat_timeout_s, rdzv, **options, join_attempt=joins, first=first
            )
        attempt = uuid.uuid4().hex[:12]
        agent = uses_agent(spec, planned.placement, args.doctor)
        env = contract_env(launch_env(spec, dict(os.environ), available_cores(), attempt), agent, rdzv)
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        op = operation(args, cfg.run_dir, attempt, spec.gpus_per_node, lock)
        env.update(op.rank_env())
        if spec.nodes * spec.gpus_per_node > 1 and not args.doctor:
            print(road_line(live), flush=True)  # stdout: news, not a problem (stderr's one line is bad input's)
        print(f"launch: {shlex.join(argv_out)}", file=sys.stderr, flush=True)
        code = run(
            argv_out,
            env,
            rundir.status(cfg.run_dir),
            attempt,
            ranks=spec.gpus_per_node,
            op=op,
            agent=agent,
            run_dir=Path(cfg.run_dir),
        )
        if code == BAD_INPUT and config_mod.restore_resolved(settled):
            print(
                f"launch: {settled.path} is the run's previous config again (the reconfigure was refused)",
                file=sys.stderr,
            )
        return code


def road_line(live: bool, why: str = roads.RESTART.WAY_OUT) -> str:
    """The one line that says which road a multi-rank run takes (stdout: news, not a problem). Under
    recovery.live=auto (the default) every multi-rank road of the built-in worker here can be live, so
    only the way out leads to the restart; a user's program always does (PROGRAM_WHY)."""
    if live:
        return "launch: road: live (a lost rank or node costs a regroup in place; recovery.live=false: the restart)"
    return (
        f"launch: road: restart ({why}): a lost rank stops every rank; torchrun's --max-restarts or "
        "the same command again resumes from the newest checkpoint"
    )


@contextlib.contextmanager
def owned(run_dir: str | None, placement: NodePlacement, job: str | None = None) -> Iterator[runlock.RunLock | None]:
    """Node 0 owns the run dir for the launch (the other nodes join its job); taken before anything is
    written there. A live holder is bad input: one line naming it (cli.main prints it, exit 2). An elastic
    job (`job`, launch.elastic.job_key) has no node 0: every node's launcher joins the job's lock. A folder
    of the run dir linked elsewhere is refused first, on every node (rundir.check_folders)."""
    lock = None
    if run_dir:  # every node writes there (job record, logs, heartbeats), node 0 or not
        rundir.check_folders(run_dir)
    if run_dir and job is not None:
        lock = runlock.acquire(run_dir, command=list(sys.argv), job=job)
    elif run_dir and placement.node_rank == 0:
        lock = runlock.acquire(run_dir, command=list(sys.argv))
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def operation(
    args: argparse.Namespace, run_dir: str | Path, attempt: str, ranks: int, lock: runlock.RunLock | None = None
) -> Operation:
    """What makes this node's launch operable (status, logs, cancel, the hang watchdog): E's ops blocks.
    An elastic launcher's job record is named by its node slot in the run-dir lock (its rank is the
    rendezvous's, and changes with the group)."""
    scheduler, job_id, extra = record.scheduler_from_env(os.environ)
    node = lock.slot if lock is not None and lock.slot is not None else args.node_rank
    if lock is not None and lock.holder.job:  # one job of several launchers: status and cancel see them all
        extra = {**(extra or {}), record.ELASTIC_JOB: lock.holder.job}
    return Operation(
        run_dir,
        scheduler=scheduler,
        command=list(sys.argv),
        launch_id=attempt,
        job_id=job_id,
        node_rank=node,
        nnodes=args.nnodes,
        local_ranks=ranks,
        hang_timeout=args.hang_timeout,
        console=cli.console_of(args),
        extra=extra or None,
    )


def settle_config(cfg: config_mod.RunConfig, reconfigure: bool, lock: runlock.RunLock | None) -> config_mod.Settled:
    """RUN_DIR/config.yaml under the run-dir lock (config.settle_resolved): written once, changed only by
    --reconfigure, which is refused while other launchers of an elastic job run on it and said in one line."""
    running = len(lock.live_members(lock.holder.job)) if lock is not None and lock.holder.job else 0
    settled = config_mod.settle_resolved(cfg, reconfigure=reconfigure, running=running)
    if settled.note:
        print(settled.note, file=sys.stderr, flush=True)
    return settled


def as_typed(spec: JobSpec, args: argparse.Namespace) -> JobSpec:
    """The built-in worker's job on the recipe and overrides as typed: what --dry-run prints, so the
    command runs as printed (the ranks of a launch read RUN_DIR/config.yaml, which a dry run never
    writes; run as printed, rank 0 resolves and writes it, as `python -m train` does)."""
    return spec.replace(config=args.config, overrides=tuple(args.overrides))


def elastic_job(spec: JobSpec, placement: NodePlacement, rdzv: str, live: bool = False) -> str | None:
    """The run-dir lock's job key of a launch whose nodes come and go (every node's launcher shares it):
    an elastic one, or a live one across nodes (node 0 may be lost while the others train on, so it
    cannot own the run dir alone, and `status` must see every node's launcher); None otherwise."""
    if meets_in_run_dir(spec):
        return rdzv_file.job_key(rdzv)
    shared = spec.min_nodes is not None or (live and spec.nodes > 1)
    if not shared or placement.master_addr is None:
        return None
    return elastic.job_key(rdzv, placement.master_addr, spec.master_port)


def launch_program(args: argparse.Namespace, planned: Plan) -> int:
    """The same launch for a user's program: one rank each through the runner. Its job record, heartbeats
    and rank logs go to --run-dir when given (then `python -m launch status/logs/cancel RUN_DIR` work),
    else to the private folder of this launch."""
    attempt = uuid.uuid4().hex[:12]
    private = Path(tempfile.gettempdir()) / f"torchlaunch-{attempt}"  # status records (+ doctor recipe)
    spec, placement, program = planned.spec, planned.placement, planned.program
    assert program is not None
    module = BUILTIN_WORKER
    if args.doctor:
        module = PREFLIGHT
        spec = spec.replace(config=str(private / "doctor.yaml"))
    rdzv = rendezvous_id(spec, placement)
    argv_out = render(spec, placement, module, args.doctor)
    if args.dry_run:
        print(shlex.join(argv_out))
        return OK
    with owned(args.run_dir, placement, elastic_job(spec, placement, rdzv)) as lock:
        if meets_in_run_dir(spec) and lock is not None:
            placement = meet_in_run_dir(args.run_dir, lock, placement)
            argv_out = render(spec, placement, module, args.doctor)
        private.mkdir(mode=0o700)
        try:
            if args.doctor:
                doctor_config(private, args.run_dir or str(private / "doctor-run"))
            agent = uses_agent(spec, placement, args.doctor)
            env = launch_env(spec, dict(os.environ), available_cores(), attempt, status_folder=private)
            env = contract_env(env, agent, rdzv)
            if args.device == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            op = operation(args, args.run_dir or private / "run", attempt, spec.gpus_per_node, lock)
            env.update(op.rank_env())
            if spec.nodes * spec.gpus_per_node > 1 and not args.doctor:
                print(road_line(False, roads.RESTART.PROGRAM_WHY), flush=True)
            print(f"launch: {shlex.join(argv_out)}", file=sys.stderr, flush=True)
            return run(
                argv_out,
                env,
                private,
                attempt,
                label="training" if args.doctor else program.name,
                ranks=spec.gpus_per_node,
                op=op,
                agent=agent,
            )
        finally:
            shutil.rmtree(private, ignore_errors=True)


def meet_in_run_dir(run_dir: str, lock: runlock.RunLock, placement: NodePlacement) -> NodePlacement:
    """Ready the run-dir rendezvous of this job's incarnation (launch.rdzv_file): the run's secret, which
    seals its state, made or checked here (one line, exit 2, before anything starts); a founder clears the
    files of runs before, whose members are all gone. The placement carries the incarnation to torchrun."""
    roads.RESTART.prepare(run_dir)  # a user's program: the restart road's rendezvous in the run dir
    incarnation = lock.holder.incarnation
    if lock.founded:
        rdzv_file.sweep(run_dir, incarnation)
    return dataclasses.replace(placement, incarnation=incarnation)


def doctor_config(private: Path, run_dir: str) -> str:
    """train.preflight reads a recipe; a user's program has none, so it gets the defaults, the
    synthetic data set (nothing to read) and the run dir to probe for shared storage."""
    path = private / "doctor.yaml"
    path.write_text(f"run_dir: {json.dumps(os.path.abspath(run_dir))}\ndata:\n  name: synthetic\n")
    return str(path)
