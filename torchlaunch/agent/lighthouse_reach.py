"""Is the membership service there? One bounded look from the launcher before anything is written.

Why: a recovery.lighthouse pointing nowhere passed the launch and failed in every rank after ~19 s, each
with a traceback (issue 52). The launcher on the node can ask the same question in a few milliseconds
(a refused connection) or at most REACH_TIMEOUT_S (a host that drops packets), and say it in one line.
Both of the service's ports are asked: the Lighthouse's and its presence port (PORT+1,
live/presence.port_of), which every rank needs too. Nothing is sent: a connection that opens
is closed at once. Only where the launcher runs on a training node (launch.local) outside a scheduler's
job: a Slurm login node or a Kubernetes client may not reach the service that the nodes do, and a pod
may start before the service's pod is ready.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from torchlaunch.base import rules
from torchlaunch.exit_codes import BadInput
from torchlaunch.jobs import schedulers

REACH_TIMEOUT_S = 3.0
"""Per port: a refused connection answers at once; a service behind a host that drops packets never
does, and this bounds that wait."""


def check(lighthouse: str, timeout_s: float = REACH_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
    """BadInput (one line) unless both of the service's ports at `lighthouse` (http://HOST:PORT) accept
    a TCP connection within `timeout_s` each. Only outside a scheduler's job (schedulers.detect of `env`,
    this process's by default, finds no job): a Kubernetes pod may start before the service's own pod is
    ready, and exit 2 there is final (the podFailurePolicy never retries bad input)."""
    if schedulers.detect(os.environ if env is None else env).job_id is not None:
        return  # inside a scheduler's job
    found = rules.service_address(lighthouse, ports=2)
    if found is None:
        raise BadInput(f"launch error: recovery.lighthouse={lighthouse[:80]!r} is not http://HOST:PORT, PORT <= 65534")
    host, port = found
    for each, what in ((port, "its Lighthouse"), (port + 1, "its presence port")):
        try:
            with socket.create_connection((host, each), timeout=timeout_s):
                pass
        except OSError as e:
            why = "nothing answered" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
            raise BadInput(
                f"launch error: recovery.lighthouse={lighthouse}: {what} at {host}:{each} cannot be reached "
                f"({why}; {timeout_s:g} s): start `python -m launch.lighthouse --bind 0.0.0.0:{port} --secret-file RUN_DIR/live/secret` there, or fix the "
                "address"
            ) from None
