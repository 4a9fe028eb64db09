"""Who is in the live group: the one interface between the trainer and a membership service.

A Membership heartbeats for this rank and, asked for a quorum, answers with the members that asked
at about the same time and are still heartbeating. A rank's place in the group (its rank and the
world size) follows from the quorum alone, identically on every member: members sorted by id.
Torch-free and torchft-free: the trainer and the unit tests use this module without either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torchlaunch.base.untrusted import whole

FORM_MIN_S = 2.0
"""The least a member of a new quorum waits for the others (forming_bound_s)."""


def forming_bound_s(heartbeat_timeout_s: float) -> float:
    """How long a new group waits for a member that is heartbeating but not there yet: twice the heartbeat
    bound, at least FORM_MIN_S. The members of a quorum leave the service's quorum at once, and a rank
    that lost its group notices within the heartbeat bound (live/peers.py), so one missing for
    twice that is gone. The one bound serves both waits: a member's wait for the others' proofs
    (group.LiveGroup.forming) and the Lighthouse's wait for heartbeating replicas that do not ask
    (its join timeout, lighthouse.join_timeout_ms): so a stranger that heartbeats without asking holds a
    quorum this long at most, not torchft's 60 s default (issue 52)."""
    return max(FORM_MIN_S, 2 * heartbeat_timeout_s)


@dataclass(frozen=True)
class Member:
    """One rank as the membership service knows it."""

    replica_id: str
    """Stable for the life of the rank's process; sorts the members (replica_id_of)."""
    store_address: str
    """HOST:PORT of the TCP store this rank hosts: the group's store when this member is rank 0."""
    step: int
    """The global steps this rank had committed when it asked: equal on every member of a sound group."""


@dataclass(frozen=True)
class Quorum:
    """A group agreed by the membership service."""

    quorum_id: int
    """The service's counter: new whenever the members change (restarts at 1 with the service)."""
    token: str
    """Unique per quorum across service restarts (id + creation time): names the group's store keys."""
    members: tuple[Member, ...]
    """Sorted by replica_id: member i is rank i."""


class Membership(Protocol):
    """The membership seam. start() begins heartbeats; quorum() blocks until the service forms a group
    that includes this rank (or raises TimeoutError after timeout_s); present() says this rank holds a
    seat in a formed group (the service then hears of its end at once: live/presence.py);
    close() stops heartbeating and leaves."""

    replica_id: str

    def start(self) -> None: ...

    def present(self) -> None: ...

    def quorum(self, step: int, store_address: str, timeout_s: float) -> Quorum: ...

    def close(self) -> None: ...


def replica_id_of(rank: int, attempt: int = 0, run: str = "") -> str:
    """The id of the rank that started as `rank`: zero-padded so that sorting ids keeps the ranks'
    order, so survivors keep their relative order (and rank 0, when it survives, stays rank 0). A rank
    started again (`attempt` >= 1, recovery.rejoin) sorts after every first one ("rejoin" > "rank"):
    joining never moves the ranks that train, rank 0 and its logs included. `run`: the run's tag
    (runkey.RunKey.tag), the same prefix on every id of a run, so two runs on one service never share an
    id and their order is kept."""
    own = f"rank{rank:06d}" if attempt == 0 else f"rejoin{attempt:03d}-rank{rank:06d}"
    return f"{run}-{own}" if run else own


def started_as(replica_id: str) -> int | None:
    """The launch rank a replica id names (replica_id_of's inverse: its trailing number), or None."""
    digits = replica_id.rsplit("rank", 1)[-1]
    return whole(digits, 9)


def twin(quorum: Quorum, replica_id: str) -> str | None:
    """A member that trains (not joining) under the same launch rank as joining `replica_id`: the rank
    runs already, so `replica_id` is a second launch of its node, not a replacement (None: none)."""
    mine = started_as(replica_id)
    for m in quorum.members:
        if m.replica_id != replica_id and m.step != JOINING_STEP and started_as(m.replica_id) == mine:
            return m.replica_id
    return None


def seat(quorum: Quorum, replica_id: str) -> tuple[int, int]:
    """(rank, world size) of `replica_id` in `quorum`; ValueError if it is not a member (fenced out)."""
    ids = [m.replica_id for m in quorum.members]
    if replica_id not in ids:
        raise ValueError(f"{replica_id} is not in quorum {quorum.quorum_id} ({', '.join(ids)})")
    return ids.index(replica_id), len(ids)


def sorted_members(members: list[Member]) -> tuple[Member, ...]:
    return tuple(sorted(members, key=lambda m: m.replica_id))


JOINING_STEP = -1
"""The step a rank started again (recovery.rejoin) asks with: it holds no state yet."""


def behind(quorum: Quorum) -> tuple[str, ...]:
    """The members that must take the state of the newest one (source): a rank started again (it holds
    none), and a survivor one step behind another. With 3+ ranks a loss can land after one member's
    all-reduce completed (it had every contribution, so its optimizer step is the uninterrupted run's)
    and before the others': that member is a step ahead, and the others heal from it rather than it
    being thrown back (no member keeps the state before its step)."""
    trained = [m.step for m in quorum.members if m.step != JOINING_STEP]
    newest = max(trained, default=JOINING_STEP)
    return tuple(m.replica_id for m in quorum.members if m.step < newest or m.step == JOINING_STEP)


def source(quorum: Quorum) -> int | None:
    """The rank whose state joining ranks take: the first member at the newest step (None: all join)."""
    trained = [(i, m.step) for i, m in enumerate(quorum.members) if m.step != JOINING_STEP]
    if not trained:
        return None
    newest = max(step for _, step in trained)
    return next(i for i, step in trained if step == newest)
