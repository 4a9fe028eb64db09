"""What the membership service's front costs a member (live/front.py): one heartbeat and one
quorum through the member's relay and the service's front ÷ the same call straight to torchft's
Lighthouse on its loopback port, in one process, interleaved.

    python -m bench.front                  # 5 rounds of 200 heartbeats and 50 quorums per side
    python -m bench.front --rounds 3 --calls 100

Both sides talk to the same Lighthouse (started keyed, with a 1 ms quorum tick so that a quorum of one
is answered by the next tick rather than the 20 ms default); each round runs the sides in alternating
order and the figure is the median of the per-round ratios. The regroup's own figure is bench/live.py's
(a regroup makes a handful of these calls).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from torchlaunch import contract
from torchlaunch.agent.live import free_port_pair
from torchlaunch.live import front, lighthouse


def per_call_us(call: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


def after_restart_ms(service: lighthouse.Service, client: object) -> float:
    """The service restarted (as on a rank's loss) -> the first quorum answered, asked as
    LighthouseMembership.quorum asks (the first call after a restart may fail while it reconnects)."""
    service.restart(1)
    started = time.perf_counter()
    lighthouse.asked_until(
        lambda left: client.quorum(replica_id="bench-rank000000", timeout=timedelta(seconds=left)),  # type: ignore[attr-defined]
        10.0,
    )
    return (time.perf_counter() - started) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="heartbeats per side per round (quorums: a quarter)")
    args = parser.parse_args(argv)
    os.environ[contract.LIVE_PRESENCE_KEY] = secrets.token_hex(32)
    key = bytes.fromhex(os.environ[contract.LIVE_PRESENCE_KEY])
    port = free_port_pair()
    service = lighthouse.Service(
        lighthouse.parse_args(["--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms", "60000", "--tick-ms", "1"])
    )
    try:
        host, backend = service._target()
        relay = front.connect(key, f"http://127.0.0.1:{port}")
        clients = {
            "direct": lighthouse._torchft().LighthouseClient(f"http://{host}:{backend}", timedelta(seconds=5)),
            "front": lighthouse._torchft().LighthouseClient(relay.address, timedelta(seconds=5)),
        }
        quorum_calls = max(1, args.calls // 4)
        figures: dict[str, dict[str, list[float]]] = {
            k: {"heartbeat": [], "quorum": [], "restart": []} for k in clients
        }
        for round_ in range(args.rounds + 1):  # round 0 warms both up and is not counted
            order = list(clients) if round_ % 2 else list(reversed(clients))
            for side in order:
                client = clients[side]
                lighthouse.asked_until(  # its connection may have ended with the other side's restart
                    lambda left, c=client: c.heartbeat("bench-rank000000", timedelta(seconds=left)), 10.0
                )
                beat = per_call_us(lambda c=client: c.heartbeat("bench-rank000000"), args.calls)
                asked = per_call_us(
                    lambda c=client: c.quorum(replica_id="bench-rank000000", timeout=timedelta(seconds=5)),
                    quorum_calls,
                )
                if round_:
                    figures[side]["heartbeat"].append(beat)
                    figures[side]["quorum"].append(asked)
                    figures[side]["restart"].append(after_restart_ms(service, client))
        for what in ("heartbeat", "quorum"):
            ratios = [f / d for f, d in zip(figures["front"][what], figures["direct"][what], strict=True)]
            print(
                f"{what}: through the front {statistics.median(figures['front'][what]):.0f} us, "
                f"direct {statistics.median(figures['direct'][what]):.0f} us per call; "
                f"front ÷ direct {statistics.median(ratios):.2f} (median of {args.rounds} rounds, "
                f"{args.calls if what == 'heartbeat' else quorum_calls} calls each; load {os.getloadavg()[0]:.1f})"
            )
        for what in ("restart",):
            ratios = [f / d for f, d in zip(figures["front"][what], figures["direct"][what], strict=True)]
            print(
                f"service restarted -> first quorum answered: through the front "
                f"{statistics.median(figures['front'][what]):.1f} ms, direct "
                f"{statistics.median(figures['direct'][what]):.1f} ms; front ÷ direct {statistics.median(ratios):.2f}"
            )
        relay.close()
    finally:
        service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
