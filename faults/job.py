"""One attempt of a 2-node job: the same command started on every node, waited on with a deadline."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from faults.netns import Cluster, Node

REPO = Path(__file__).resolve().parent.parent


def node_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for node commands: this checkout importable, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra or {})
    return env


def torchrun_argv(node: Node, script: Sequence[str], max_restarts: int = 0, nnodes: int = 2) -> list[str]:
    """Plain torchrun for harness tests (the real suite uses launch.local instead)."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
        f"--node-rank={node.index}", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500",
        "--rdzv-conf=join_timeout=60", f"--max-restarts={max_restarts}", *script,
    ]  # fmt: skip


@dataclass
class Attempt:
    """The processes of one attempt and when they ended."""

    cluster: Cluster
    run_dir: Path
    log_prefix: str
    started_at: float = field(default_factory=time.monotonic)
    popens: list = field(default_factory=list)
    ended_at: dict[int, float] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        cluster: Cluster,
        argv_for: Callable[[Node], Sequence[str]],
        run_dir: str | os.PathLike[str],
        log_prefix: str,
        env: Mapping[str, str] | None = None,
    ) -> Attempt:
        attempt = cls(cluster=cluster, run_dir=Path(run_dir), log_prefix=log_prefix)
        for node in cluster.nodes:
            log = attempt.run_dir.parent / f"{log_prefix}-{node.hostname}.log"
            attempt.popens.append(cluster.start(node, argv_for(node), log, env=node_env(env), cwd=REPO))
        return attempt

    def poll(self) -> list[int | None]:
        codes = [p.poll() for p in self.popens]
        for k, code in enumerate(codes):
            if code is not None and k not in self.ended_at:
                self.ended_at[k] = time.monotonic()
        return codes

    def dead_reason(self) -> str | None:
        """Why waiting for progress is pointless: some node's command already ended."""
        codes = self.poll()
        ended = {f"node{k}": c for k, c in enumerate(codes) if c is not None}
        return f"node commands ended early: {ended}; see {self.logs()}" if ended else None

    def wait(self, timeout_s: float) -> list[int]:
        """Exit codes of all nodes; raises TimeoutError (after killing nothing) if any runs past the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            codes = self.poll()
            if all(c is not None for c in codes):
                return [int(c) for c in codes]  # type: ignore[arg-type]
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes still running after {timeout_s}s (codes {codes}); see {self.logs()}")
            time.sleep(0.05)

    def seconds_to_end(self, k: int, since: float) -> float:
        return self.ended_at[k] - since

    def logs(self) -> list[str]:
        return [str(self.run_dir.parent / f"{self.log_prefix}-{n.hostname}.log") for n in self.cluster.nodes]

    def log_text(self) -> str:
        parts = []
        for path in self.logs():
            try:
                parts.append(f"==> {path}\n" + Path(path).read_text()[-4000:])
            except FileNotFoundError:
                pass
        return "\n".join(parts)
