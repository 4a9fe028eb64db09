"""The membership seam backed by torchft's Lighthouse (the `live` extra: torchft==0.2.0).

Why the Lighthouse: it is a small service that forms a quorum from the replicas that ask and are
still heartbeating, refuses a group of half or fewer of the heartbeating replicas (no split brain),
and keeps only soft state, so it can run anywhere and be restarted. It runs in a process of its own
(`python -m torchlaunch.core.recovery.lighthouse`, started by the local launcher in live mode), never
inside a training rank, so the loss of any rank, rank 0 included, leaves it up.

What is used of torchft: LighthouseServer and LighthouseClient (heartbeat, quorum) only. Its Manager,
DDP wrapper and sampler are not: the trainer keeps its own exact plan and gradient averaging.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from datetime import timedelta

from torchlaunch.core.recovery.membership import Member, Quorum, sorted_members

HEARTBEATS_PER_TIMEOUT = 10
"""Heartbeats sent per heartbeat timeout: a live rank is never taken for lost by one late beat."""
CONNECT_TIMEOUT_S = 10.0
RETRY_S = 0.05
"""Pause between quorum requests to a service that did not answer (being restarted)."""


def _torchft():  # noqa: ANN202 - the module itself
    """torchft's bindings, or one line naming the extra to install."""
    try:
        from torchft import _torchft
    except ImportError:
        from torchlaunch.exit_codes import ConfigError

        raise ConfigError(
            "recovery.live", "needs torchft, which is not installed", "pip install 'torchlaunch[live]'"
        ) from None
    return _torchft


class LighthouseMembership:
    """This rank's heartbeats to the Lighthouse (a daemon thread) and its quorum requests."""

    def __init__(self, address: str, replica_id: str, heartbeat_timeout_s: float) -> None:
        self.address, self.replica_id = address, replica_id
        self.interval_s = heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT
        self._client = _torchft().LighthouseClient(address, timedelta(seconds=CONNECT_TIMEOUT_S))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """One heartbeat now (the service knows this rank before start() returns), then a thread."""
        self._client.heartbeat(self.replica_id)
        self._thread = threading.Thread(target=self._beat, name="torchlaunch-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._client.heartbeat(self.replica_id, timedelta(seconds=max(1.0, self.interval_s * 5)))
            except Exception:  # the service is restarting: the next beat reaches the new one
                continue

    def quorum(self, step: int, store_address: str, timeout_s: float) -> Quorum:
        """Ask until the service answers or `timeout_s` has passed: a service being restarted refuses
        connections for a moment, and the client's first call after a restart fails once while it
        reconnects (measured, torchft 0.2.0)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                found = self._client.quorum(
                    replica_id=self.replica_id,
                    timeout=timedelta(seconds=max(left, 0.1)),
                    store_address=store_address,
                    step=step,
                )
                break
            except Exception as e:  # unreachable (retried) or timed out
                if time.monotonic() + RETRY_S >= deadline:
                    raise TimeoutError(f"no live group within {timeout_s:g} s from {self.address}: {e}") from None
                time.sleep(RETRY_S)
        members = [Member(p.replica_id, p.store_address, int(p.step)) for p in found.participants]
        created = found.created
        token = f"{found.quorum_id}-{created.seconds}.{created.nanos:09d}"
        return Quorum(int(found.quorum_id), token, sorted_members(members))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torchlaunch.core.recovery.lighthouse", description="The live group's membership service."
    )
    parser.add_argument("--bind", required=True, help="HOST:PORT to listen on")
    parser.add_argument("--min-ranks", type=int, default=1, help="smallest group that may train")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    parser.add_argument("--join-timeout-ms", type=int, default=60_000, help="how long a group waits for stragglers")
    parser.add_argument("--tick-ms", type=int, default=20, help="how often the service checks for a quorum")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the state is soft, so a restart on the same address is a new service
    that the ranks' next heartbeats and quorum requests fill again."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    server = _torchft().LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_ranks,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"lighthouse: serving {args.bind}", file=sys.stderr, flush=True)
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
