"""Live recovery: a lost rank costs its peers a regroup, not a restart (recovery.live, issue #37).

The seam is one interface, membership.Membership: heartbeats, and a quorum (who is in the group now)
on request. Its only implementation today is lighthouse.LighthouseMembership, backed by torchft's
Lighthouse, which runs in a process of its own beside the ranks (started and restarted by the local
launcher), so losing any rank, rank 0 included, leaves the service up. Nothing outside this package
imports torchft, and this package imports it only when live mode is on.

The pieces, one job each:
- membership: who is in the group (Member, Quorum, the Membership protocol, seat()), pure
- failure: which exceptions mean "a peer is gone" (a transport error), as opposed to a timeout, pure
- replan: the batch plan on the ranks left, and the record of each regroup (torch: imported by its users,
  not here, so the live agent, which imports this package for its pulse watch, starts without torch)
- fence: the run dir's group generation; only the live group's ranks may commit a checkpoint
- minimum: the fewest ranks a group trains on (a launcher's node range); below it, checkpoint and exit 75
- group: this rank's seat: the quorum, and the process group re-formed in place
- stores: this rank's own store behind its front, and its relay to a peer's
- grads: gradient averaging (and the first broadcast) without DDP
- handover: a peer's state to a rank that has none, and the digest that shows they agree
- lighthouse: the torchft-backed Membership, and the membership service's own process
- pulse: a rank's beats to its agent, and the agent's watch that fences a silent rank
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Fence": "fence",
    "Fenced": "fence",
    "Member": "membership",
    "Membership": "membership",
    "Quorum": "membership",
    "is_peer_lost": "failure",
    "seat": "membership",
}
"""name -> its module: resolved on first use (PEP 562), so that importing one light module of the
package (minimum, failure: every worker does) does not import the others (bench.startup)."""


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = ["Fence", "Fenced", "Member", "Membership", "Quorum", "is_peer_lost", "seat"]
