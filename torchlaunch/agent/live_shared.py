"""What every backend's live mode (recovery.live) shares on the launch side: the address a node's ranks
give out their stores at, and the job's outcome from its ranks' exit codes. The local live agent and
the Slurm batch script's verdict both use them, so a job lost or won reads the same under either.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from torchlaunch.base import rules
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED

LOOPBACK = "127.0.0.1"


def store_host(nnodes: int, master_addr: str, lighthouse: str) -> str:
    """The address this node's ranks give their stores (the one the other nodes reach it on): loopback
    on one node, else this host's source address toward the service (or node 0), as the kernel routes
    it. A UDP connect sends nothing; it only picks the route."""
    if nnodes == 1:
        return LOOPBACK
    found = rules.service_address(lighthouse)
    toward = found[0] if found is not None else master_addr
    try:
        with socket.socket(socket.AF_INET6 if ":" in toward else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((toward, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def job_code(codes: Sequence[int]) -> int:
    """The job's code from its ranks' return codes (negative: ended by that signal) (pure). A rank lost
    while the others finished is what live mode is for: the job's outcome is the survivors'. A rank
    that exited non-zero by itself (bad input, a failure, a preemption) gives the job its code."""
    exited = [c for c in codes if c >= 0]
    if not exited:
        return FAILURE  # every rank was lost: nothing finished
    for code in (BAD_INPUT, FAILURE, PREEMPTED):
        if code in exited:
            return code
    return OK if all(c == OK for c in exited) else FAILURE
