"""Which collective failures mean "a peer is gone".

A crashed or killed peer's sockets are closed by its kernel, so the survivors' gloo pairs fail at once
with a read or write error (connection reset or closed, broken pipe): that error is the detection, in
tens of milliseconds, with no timeout involved. A timeout is different: the peer may be hung, slow or
partitioned and still alive, so regrouping without it could leave two groups; it stays a failure of
the job (the membership service's heartbeat bound is what handles a silent peer).
"""

from __future__ import annotations

TRANSPORT_ERRORS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "end of file",
)
"""Lower-case fragments of gloo's (and the TCP store's) messages when a peer's socket went away."""

TIMEOUT_ERRORS = ("timed out", "timeout")


def is_peer_lost(error: BaseException) -> bool:
    """True for a transport error of a lost peer (RuntimeError or torch's DistError family, whose
    messages name the cause); False for timeouts and anything else."""
    if not isinstance(error, RuntimeError | ConnectionError | OSError):
        return False
    text = str(error).lower()
    if any(t in text for t in TIMEOUT_ERRORS):
        return False
    return any(t in text for t in TRANSPORT_ERRORS)
