"""`python -m launch status|logs|cancel|list`: one handle, the run dir, for a job started by any launcher.

    python -m launch status RUN_DIR [--json]       state, step/total, images/s, ETA, checkpoint, ranks
    python -m launch logs RUN_DIR [--rank R] [--follow]
    python -m launch cancel RUN_DIR [--dry-run]    a clean stop: checkpoint, state cancelled, no requeue
    python -m launch list [DIR] [--json]           one line per run under DIR (default runs/)

Bad input (no such run dir, no job record to cancel, a bad option) is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from torchlaunch.base.files import printable
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, BadInput
from torchlaunch.exit_codes import LaunchParser as Parser
from torchlaunch.jobs import gather, ranklog, record, schedulers, state, watchdog

FOLLOW_POLL_S = 0.5


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(max(seconds, 0))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 2 * 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _clean(value: object) -> str:
    return "-" if value is None else printable(str(value))


def _run_dir(path: str) -> Path:
    run = Path(path)
    if not run.is_dir():
        raise BadInput(f"launch error: run dir {printable(path)} does not exist (pass the run_dir of a launched job)")
    return run


def render_status(run: Path, st: state.Status, now: float) -> str:
    lines = [f"run:        {_clean(run)}", f"state:      {st.state} ({_clean(st.reason)})"]
    if st.scheduler:
        lines.append(
            f"scheduler:  {_clean(st.scheduler)}  job {_clean(st.job_id)}  launch {_clean(st.launch_id)}  "
            f"hosts {_clean(','.join(st.hosts))}"
        )
    if st.started is not None:
        started = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(st.started))
        lines.append(f"started:    {started} ({_duration(now - st.started)} ago)")
    step = f"{_clean(st.step)}/{_clean(st.total)}" if st.total is not None else _clean(st.step)
    rate = f"{st.images_per_s:.1f}" if st.images_per_s is not None else "-"
    epoch = _clean(st.epoch + 1 if st.epoch is not None else None)  # counted from 1, as the console counts
    lines.append(f"step:       {step}  epoch {epoch}  images/s {rate}  ETA {_duration(st.eta_s)}")
    if st.world_size is not None or st.world_change is not None:
        world = f"{st.world_size} ranks" if st.world_size is not None else "-"
        change = f"; last change at {st.world_change.text()}" if st.world_change is not None else ""
        lines.append(f"world:      {world}{change}")
    if st.regroups:
        shown = "; ".join(r.text() for r in st.regroups[-3:])
        more = f" (the last 3 of {len(st.regroups)})" if len(st.regroups) > 3 else ""
        lines.append(f"live:       {len(st.regroups)} regroup(s){more}: {shown}")
    if st.checkpoint is not None:
        lines.append(
            f"checkpoint: {_clean(Path(st.checkpoint.path).name)} (step {st.checkpoint.step}, "
            f"{_duration(st.checkpoint_age_s)} ago, verified)"
        )
    else:
        lines.append("checkpoint: none verified")
    for r in st.ranks:
        lines.append(
            f"rank {r.rank:<5} host {_clean(r.host)}  pid {_clean(r.pid)}  step {_clean(r.step)}  "
            f"last progress {_duration(r.age_s)} ago" + ("  (process gone; the others train on)" if r.gone else "")
        )
    if st.cancel_requested and st.state != "cancelled":
        lines.append("cancel:     requested")
    lines.extend(f"note:       {_clean(p)}" for p in st.problems)
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace, out: IO[str]) -> int:
    run = _run_dir(args.run_dir)
    facts = gather.facts(run, hang_timeout=args.hang_timeout, ask_scheduler=not args.no_scheduler)
    st = state.decide(facts)
    if args.json:
        print(json.dumps({"run_dir": str(run), **st.to_json()}, sort_keys=True), file=out)
    else:
        print(render_status(run, st, facts.now), file=out)
    return OK


def _runs(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and (p / record.JOB_DIR).is_dir())
    except OSError:
        return []


def cmd_list(args: argparse.Namespace, out: IO[str]) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        raise BadInput(f"launch error: {printable(args.dir)} is not a folder (pass the folder that holds run dirs)")
    rows = []
    for run in _runs(root):
        facts = gather.facts(run, ask_scheduler=not args.no_scheduler, checkpoints=False)
        st = state.decide(facts)
        ended = max((r.ended for r in facts.records if r.ended is not None), default=None)
        age = st.last_progress_age_s if st.state == "running" else None
        if age is None:
            ref = ended or st.started
            age = facts.now - ref if ref is not None else None
        rows.append((run, st, age))
    if args.json:
        payload = [
            {"run_dir": str(run), "state": st.state, "step": st.step, "total": st.total, "age_s": age}
            for run, st, age in rows
        ]
        print(json.dumps(payload, sort_keys=True), file=out)
        return OK
    width = max([len(printable(r.name)) for r, _, _ in rows] + [3])
    print(f"{'RUN':<{width}}  {'STATE':<10} {'STEP':>15}  AGE", file=out)
    for run, st, age in rows:
        step = f"{_clean(st.step)}/{_clean(st.total)}" if st.total is not None else _clean(st.step)
        print(f"{printable(run.name):<{width}}  {st.state:<10} {step:>15}  {_duration(age)}", file=out)
    return OK


def cmd_logs(args: argparse.Namespace, out: IO[str]) -> int:
    run = _run_dir(args.run_dir)
    present = ranklog.ranks_present(run)
    if args.rank is not None and args.rank not in present:
        have = ", ".join(map(str, present)) or "none yet"
        raise BadInput(f"launch error: no log for rank {args.rank} in {printable(str(run))}/logs (ranks: {have})")
    ranks = [args.rank] if args.rank is not None else present
    if not present and not args.follow:
        print(f"launch: no rank logs in {printable(str(run))}/logs yet{_scheduler_output(run)}", file=sys.stderr)
    if not args.follow:
        shown = False
        for line in ranklog.merged(run, ranks):
            print(line, file=out)
            shown = True
        if present and not shown:
            print(f"launch: {_silent(ranks)} (`--rank 0` or no --rank: every rank's)", file=sys.stderr)
        return OK
    return follow(run, args.rank, out)


def _silent(ranks: list[int]) -> str:
    """Why a log can be empty: the built-in worker prints its progress from rank 0 only; the other ranks
    write only their warnings and errors (a user's program may print from every rank)."""
    which = f"rank {ranks[0]}'s log is" if len(ranks) == 1 else "the ranks' logs are"
    return f"{which} empty: the built-in worker prints progress from rank 0 only, the others only warnings and errors"


def _scheduler_output(run: Path) -> str:
    """`; the scheduler's own output: PATHS` when the newest launch's scheduler keeps files of its own."""
    nodes = state.current_launch(record.read_all(run)[0])
    backend = schedulers.get(nodes[0].scheduler) if nodes else None
    found = backend.logs(run, nodes[0].job_id) if backend is not None else []
    return f"; the scheduler's own output: {printable(' '.join(map(str, found[:8])))}" if found else ""


def follow(run: Path, rank: int | None, out: IO[str]) -> int:
    """Print new lines as they are written, until the job has ended and its logs stopped growing."""
    offsets: dict[int, int | None] = {}
    while True:
        ranks = [rank] if rank is not None else ranklog.ranks_present(run)
        batch = []
        for r in ranks:
            lines, offsets[r] = ranklog.read_lines(ranklog.log_path(run, r), r, offsets.get(r))
            batch.extend(lines)
        for _, r, _, text in sorted(batch, key=lambda item: (item[0], item[1], item[2])):
            print(f"[rank {r}] {text.decode('utf-8', 'replace')}", file=out)
        out.flush()
        if not batch:
            nodes = state.current_launch(record.read_all(run)[0])
            if nodes and all(n.outcome is not None for n in nodes):
                return OK
            time.sleep(FOLLOW_POLL_S)  # waiting for new output, not synchronising with anything


def cancel_plan(run: Path, st: state.Status, nodes: Sequence[record.JobRecord]) -> list[schedulers.Step]:
    """What a clean stop takes, as the record's scheduler says (torchlaunch.jobs.schedulers): SIGTERM to a
    launcher on this host, a scheduler command to run, or a command the user must run elsewhere."""
    node0 = min(nodes, key=lambda r: r.node_rank)
    backend = schedulers.get(node0.scheduler) or schedulers.get("local")
    assert backend is not None
    return backend.cancel(run, nodes)


def cmd_cancel(args: argparse.Namespace, out: IO[str]) -> int:
    run = _run_dir(args.run_dir)
    facts = gather.facts(run, ask_scheduler=True, checkpoints=False)
    st = state.decide(facts)
    nodes = state.current_launch(facts.records)
    if not nodes:
        raise BadInput(
            f"launch error: {printable(str(run))} has no job record (nothing to cancel; "
            "stop the job with its scheduler's own tool)"
        )
    if st.state in ("finished", "failed", "bad_input", "cancelled", "preempted", "hung"):
        print(f"cancel: the run is already {st.state}; nothing to stop (it is not requeued)", file=out)
        if st.state in ("preempted", "hung") and not args.dry_run:
            record.request_cancel(run, nodes[0].launch_id, "after the end", record.elastic_job(nodes[0]))
        return OK
    steps = cancel_plan(run, st, nodes)
    if args.dry_run:
        print(f"cancel (dry run): mark launch {nodes[0].launch_id} cancelled in {run}/job/cancel.json", file=out)
        for step in steps:
            text = f"kill -TERM {step.pid}" if step.kind == "signal" else shlex.join(step.argv)
            print(f"cancel (dry run): {text}", file=out)
        return OK
    if not steps:
        print(f"cancel: no running launcher of {printable(str(run))} found on this host ({st.state})", file=out)
        return FAILURE
    record.request_cancel(run, nodes[0].launch_id, ",".join(step.kind for step in steps), record.elastic_job(nodes[0]))
    code = OK
    for step in steps:
        if step.kind == "signal" and step.pid is not None:
            os.kill(step.pid, signal.SIGTERM)
            print(f"cancel: asked launcher pid {step.pid} to checkpoint and stop (SIGTERM)", file=out)
        elif step.kind == "run":
            argv = list(step.argv)
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
                failed = done.returncode != 0
                detail = (done.stderr or "").strip().splitlines()[:1]
            except (OSError, subprocess.TimeoutExpired) as e:
                failed, detail = True, [str(e)]
            if failed:
                print(f"cancel: {shlex.join(argv)} failed: {printable(' '.join(detail))}", file=out)
                code = FAILURE
            else:
                print(f"cancel: {shlex.join(argv)} (the ranks checkpoint on SIGTERM; not requeued)", file=out)
        else:
            print(f"cancel: run this to stop it: {shlex.join(step.argv)}", file=out)
    print("cancel: the same launch command resumes from the checkpoint", file=out)
    return code


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="python -m launch", description="Operate a launched job through its run dir.")
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    p = sub.add_parser("status", help="state, progress, checkpoint and ranks of one run")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--hang-timeout", type=watchdog.parse_timeout, default=None, help="seconds; default max(600, 50 x step time)"
    )
    p.add_argument("--no-scheduler", action="store_true", help="do not ask squeue/sacct/kubectl")
    p = sub.add_parser("logs", help="the ranks' output with [rank N] prefixes")
    p.add_argument("run_dir")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--follow", "-f", action="store_true")
    p = sub.add_parser("cancel", help="a clean stop: checkpoint, state cancelled, never requeued")
    p.add_argument("run_dir")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("list", help="one line per run under DIR")
    p.add_argument("dir", nargs="?", default="runs")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-scheduler", action="store_true")
    return top


COMMANDS = {"status": cmd_status, "logs": cmd_logs, "cancel": cmd_cancel, "list": cmd_list}


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    try:
        args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        return COMMANDS[args.command](args, out)
    except BadInput as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        return OK if getattr(locals().get("args"), "follow", False) else FAILURE
    except BrokenPipeError:  # `... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return OK


if __name__ == "__main__":
    sys.exit(main())
