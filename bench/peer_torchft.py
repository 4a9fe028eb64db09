"""torchft's own fault-tolerant loop beside live mode, on the same box, model and batch (issue #37).

    python -m bench.peer_torchft                         # 3 rounds: SIGKILL replica 1 at step 12
    python -m bench.peer_torchft --heartbeat-timeout 5   # torchft's Lighthouse default

Each replica is one process (a replica group of one rank, as torchft's train_ddp.py runs on CPU): its
own TCP store, torchft's Manager and reconfigurable ProcessGroupGloo, the membership service (the same
Lighthouse live mode runs, `python -m torchlaunch.live.lighthouse`) in a process of its own.
The step is torchft's protocol: the Manager's quorum at the start of the step (its OptimizerWrapper's
zero_grad), forward and backward, one flat `manager.allreduce` of the gradients (torchft's DDP wrapper
is not used: its comm hook dies on the survivor when the peer is lost mid-all-reduce, issue #37), and
the optimizer step only if `manager.should_commit()`. The model and data are live mode's benchmark's:
tiny_gn_cnn (width 8, 10 classes) on 16 px synthetic images, 8 per replica per step, SGD lr 0.05.

Each replica appends one line per step to OUT/replica-R.jsonl (time, step, committed, participants).
The figure: SIGKILL of replica 1 (once its log shows step KILL_AT) -> the survivor's first committed
step after it. Also the steady rate of the two replicas, nothing killed (images/s per replica x 2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KILL_AT = 12
PER_REPLICA = 8
IMAGE_SIZE = 16


def replica_main(replica: int, lighthouse: str, out: Path, steps: int, store_port: int) -> int:
    """One replica's loop (runs in its own process)."""
    import torch
    import torch.distributed
    from torch import nn
    from torchft import Manager, ProcessGroupGloo

    from examples.my_models import tiny_gn_cnn

    torch.set_num_threads(1)
    # the replica group's store, which the Manager expects to find running (torchrun's, in train_ddp.py)
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)  # the same initial weights on every replica (torchft heals only a late joiner)
    model = tiny_gn_cnn(10, width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=lambda state: (
            model.load_state_dict(state["model"]),
            optimizer.load_state_dict(state["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"replica{replica}",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=10),
    )
    # Both replicas heartbeat before either asks for a quorum: else the Lighthouse may form the first
    # one from whichever came first (min_replica_size=1), which then trains alone until the other heals
    (out / f"ready-{replica}").touch()
    while not all((out / f"ready-{r}").exists() for r in range(2)):
        time.sleep(0.01)
    data = torch.Generator().manual_seed(replica)
    log = (out / f"replica-{replica}.jsonl").open("a", buffering=1)
    while manager.current_step() < steps:
        x = torch.randn(PER_REPLICA, 3, IMAGE_SIZE, IMAGE_SIZE, generator=data)
        y = torch.randint(0, 10, (PER_REPLICA,), generator=data)
        manager.start_quorum()  # what torchft's OptimizerWrapper.zero_grad does
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        committed = manager.should_commit()
        if committed:
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            optimizer.step()
        record = {"time": time.time(), "step": manager.current_step(), "committed": committed}
        record["participants"] = manager.num_participants()
        log.write(json.dumps(record) + "\n")
    manager.shutdown(wait=False)
    del store
    return 0


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return found


@dataclass
class PeerRun:
    code: list[int]
    killed_at: float | None
    survivor: list[dict]
    stderr: str

    def recovery_s(self) -> float | None:
        """SIGKILL -> the survivor's first committed step in a quorum without the lost replica (as live
        mode's figure counts the first step on the new group): a step in flight at the kill whose
        all-reduce had already finished commits a moment later on the old quorum, and taken for the
        recovery it made one round in three read ~0.2 ms."""
        if self.killed_at is None:
            return None
        after = [
            r["time"]
            for r in self.survivor
            if r["time"] > self.killed_at and r["committed"] and r.get("participants", 1) < 2
        ]
        return min(after) - self.killed_at if after else None

    def discarded(self) -> int:
        """Steps the survivor trained and threw away (should_commit False) around the loss."""
        return sum(1 for r in self.survivor if not r["committed"])

    def images_per_s(self, skip: int = 16, window: int = 8) -> float:
        """Both replicas' images/s, nothing killed: the median over windows of `window` committed steps
        (live mode's log windows are 8 steps), the first `skip` steps (warm-up) left out."""
        times = [r["time"] for r in self.survivor if r["committed"]][skip:]
        rates = [
            window * PER_REPLICA * 2 / (times[i + window] - times[i]) for i in range(0, len(times) - window, window)
        ]
        return statistics.median(rates)


def run(out: Path, victim: int | None, steps: int, heartbeat_timeout_s: float, timeout_s: float = 180.0) -> PeerRun:
    """Two replicas and a Lighthouse; SIGKILL replica `victim` at its step KILL_AT (None: no kill)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUST_LOG": "error"}
    port = free_port()
    lighthouse = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchlaunch.live.lighthouse",
            "--bind",
            f"127.0.0.1:{port}",
            "--heartbeat-timeout-ms",
            str(round(heartbeat_timeout_s * 1000)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    replicas: list[subprocess.Popen] = []
    killed_at = None
    deadline = time.monotonic() + timeout_s
    try:
        from torchlaunch.launch import elastic

        while not elastic.listening("127.0.0.1", port, timeout_s=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError("the Lighthouse did not start")
            time.sleep(0.05)
        for r in range(2):
            argv = [sys.executable, "-m", "bench.peer_torchft", "--replica", str(r), "--lighthouse"]
            argv += [f"http://127.0.0.1:{port}", "--out", str(out), "--steps", str(steps)]
            argv += ["--store-port", str(free_port())]
            replicas.append(
                subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            )
        while victim is not None and killed_at is None and replicas[victim].poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {victim} never reached step {KILL_AT}")
            done = records(out / f"replica-{victim}.jsonl")
            if done and done[-1]["step"] >= KILL_AT and done[-1]["participants"] == 2:
                os.kill(replicas[victim].pid, signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.005)
        errors = []
        for proc in replicas:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            errors.append(err[-2000:])
    finally:
        for proc in [*replicas, lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    survivor = 0 if victim != 0 else 1
    return PeerRun(
        [p.returncode for p in replicas], killed_at, records(out / f"replica-{survivor}.jsonl"), "\n".join(errors)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_torchft", description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", default="/tmp/torchlaunch-bench-torchft")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0, help="the Lighthouse's, in seconds")
    args = parser.parse_args(argv)
    if args.replica is not None:
        return replica_main(args.replica, args.lighthouse, Path(args.out), args.steps, args.store_port)
    import shutil

    figures = []
    for round_ in range(args.rounds):
        out = Path(args.out) / f"r{round_}"
        shutil.rmtree(out, ignore_errors=True)
        result = run(out, 1, args.steps, args.heartbeat_timeout)
        seconds = result.recovery_s()
        print(
            f"round {round_}: SIGKILL replica 1 -> first committed step on the survivor "
            f"{seconds if seconds is None else round(seconds, 2)} s, {result.discarded()} step(s) discarded, "
            f"exit codes {result.code}",
            flush=True,
        )
        if seconds is None:
            print(result.stderr, file=sys.stderr)
            return 1
        figures.append(seconds)
    print(
        f"torchft: SIGKILL replica 1 -> first committed step on the survivor: median {statistics.median(figures):.2f} s "
        f"[{min(figures):.2f}-{max(figures):.2f}], Lighthouse heartbeat timeout {args.heartbeat_timeout:g} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
