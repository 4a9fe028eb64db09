"""This rank's seat in the live group: its own store, the quorum, and the process group re-formed in
place (the process, model, optimizer and loaders stay as they are).

Each rank's own store is live/stores.py's; the gradients, averaged by hand rather than by DDP,
live/grads.py's; a peer's state handed to a joining rank, live/handover.py's.

Why a broken group's connections are shut down: a member that lost no direct peer (3+ ranks) may
still wait in the broken collective on a live one; it learns of the loss only when the live one's gloo
connections close, and destroying a group does not close them while anything refers to it (the
error's traceback, a posted collective). So each group's sockets are recorded when it forms and shut
down when it breaks (live/sockets.py), and the trainer lets the error go before regrouping.

Why a broken group is let go on a thread of its own: its destructor joins gloo's worker threads, and
one may still run a collective posted before the loss (the preemption agreement's all-reduce) that no
transport error reaches, until dist.timeout_s (seen: 4 netns nodes losing 2, a survivor held 300 s
in destroy_process_group). Aborting the backend first does not end that wait in torch 2.14 (tried).
So the last reference is dropped on a daemon thread, which waits for gloo while the rank regroups;
the built-in worker leaves with os._exit (runner.exit_process), so no exit ever waits for it either.

Why the default process group is re-formed (destroy + init) rather than a wrapper group: every
collective of the worker (preemption agreement, loss sums, checkpoint, evaluation) goes through the
default group, so re-forming it re-forms all of them, and nothing else needs to know. gloo lets a
process destroy a group whose peer died and create a new one at once (measured: < 1 ms).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import hashlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from torchlaunch import rundir
from torchlaunch.core.dist import DistContext, broadcast_json, gather_json
from torchlaunch.exit_codes import BadInput
from torchlaunch.live import front, sockets
from torchlaunch.live.fence import Fence, FenceBusy, Fenced
from torchlaunch.live.membership import (
    JOINING_STEP,
    Member,
    Membership,
    Quorum,
    behind,
    forming_bound_s,
    seat,
    sorted_members,
    source,
    started_as,
    twin,
)
from torchlaunch.live.minimum import Minimum, below_minimum
from torchlaunch.live.peers import PeerWatch
from torchlaunch.live.pulse import Pulse
from torchlaunch.live.runkey import RunKey
from torchlaunch.live.stores import peer_relay, store_with_echo

STORE_HOST = "127.0.0.1"
"""The address this rank's store is given out on when its agent names none (one node: loopback). The
store listens on every interface; across nodes the agent names the one the others reach
(contract.LIVE_STORE_HOST)."""
JOIN_PREFIX = "join-"
JOIN_RETRY_S = 5.0
"""How often a waiting joiner writes its request again (and asks the service again)."""
JOIN_NAME = re.compile(r"join-(?:[0-9a-f]{8}-)?rejoin\d{3,9}-rank\d{6}", re.ASCII)
"""RUN_DIR/live/join-<replica id>: a rank started again waits to be admitted (what the others look for)."""


class LiveGroup:
    """The membership, this rank's store, the group's generation (fence) and this rank's pulse to its
    agent (None where the launcher watches none)."""

    def __init__(
        self,
        membership: Membership,
        fence: Fence,
        timeout_s: float,
        quorum_timeout_s: float,
        host: str = STORE_HOST,
        pulse: Pulse | None = None,
        heartbeat_timeout_s: float | None = None,
        minimum: Minimum | None = None,
        key: RunKey | None = None,
    ) -> None:
        self.membership, self.fence, self.pulse = membership, fence, pulse
        self.key = key
        """The run's secret (live/runkey.py): only members that prove it are seated. None: every
        member the service names is taken at its word (unit tests of the seam only; the worker has one)."""
        self.minimum = minimum
        """The fewest ranks this group trains on (a launcher's node range, live/minimum.py); None:
        it trains on down to one rank."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.quorum_timeout_s = quorum_timeout_s
        self.store_key = key.presence_key if key is not None else None
        """What a connection to a member's store proves at its front (front.py; None: admitted unproven)."""
        self.echo, self.store, self.store_front = store_with_echo(self.store_key)
        self.store_address = f"{host}:{self.store_front.port}"
        self._relays: list[front.Relay] = []
        """This rank's ways to the current group's store (its rank 0's front), open while the group is."""
        self.forming = datetime.timedelta(seconds=min(timeout_s, forming_bound_s(heartbeat_timeout_s or 5.0)))
        """How long a new quorum's members wait for each other to form its group: they all left the
        service's quorum at once, so one missing for twice the heartbeat bound is gone (a rank started
        again and lost while it waited to be admitted: the service still counted it). A slow member
        costs a retry, never a wrong group; the survivors' pause for a lost joiner is this long."""
        self.peers = PeerWatch(heartbeat_timeout_s) if heartbeat_timeout_s else None
        """Judges a peer silent to this rank (a whole node frozen or cut off: live/peers.py)."""
        self.generation = 0
        self.quorum: Quorum | None = None
        self.joining = False
        """A rank started again that has not taken a peer's state yet (recovery.rejoin)."""
        self.started_as = 0
        """The rank its launcher started this process as: it names the rank's files (logs, trace,
        events), whatever place a later group seats it at."""
        self._sockets: frozenset[str] = frozenset()
        """The current group's connections (sockets.py): shut down when it breaks."""

    def join(self, ctx: DistContext, step: int) -> None:
        """Enter the service with the group the launcher formed (every rank of the launch). Each rank
        heartbeats before the barrier, so the service waits for all of them in the first quorum; from here
        on its agent takes a silence past the bound for a frozen rank."""
        if self.pulse is not None:
            self.pulse.start()
        if self.peers is not None:
            self.peers.start()
        self.membership.start()
        dist.barrier()
        quorum = self._first_quorum(ctx, step)
        if ctx.backend == "gloo":  # formed again on the quorum, so that its connections are known (sockets.py)
            self._leave(broken=False)
            if self._enter(ctx, quorum, forming=self.timeout).rank != ctx.rank:  # every rank just met
                raise BadInput("live error: the first quorum seats the ranks in another order than the launcher")
            return
        self.quorum = quorum
        self.membership.present()
        self.generation = self._take_generation(ctx)

    def _first_quorum(self, ctx: DistContext, step: int) -> Quorum:
        """The service's quorum of every rank of the launch. A service that outlived an earlier
        allocation of this job (a requeue, or the same command run again, against a Lighthouse of its own
        host) remembers that allocation's last group, and torchft forms a "fast quorum" as soon as all of
        those members ask again: after a loss left one rank, the new rank 0 was handed a group of itself
        alone before rank 1 had asked (seen on the dev cluster). A smaller group is asked for again, which
        the others' requests, waiting meanwhile, now complete; a larger one is another job's."""
        deadline = time.monotonic() + self.quorum_timeout_s
        while True:
            quorum = self._ask(step, max(deadline - time.monotonic(), 0.1))
            if len(quorum.members) == ctx.world_size:
                return quorum
            if len(quorum.members) > ctx.world_size or time.monotonic() >= deadline:
                raise BadInput(
                    f"live error: the membership service formed a group of {len(quorum.members)} of the "
                    f"{ctx.world_size} ranks at start (another job on its address?)"
                )
            time.sleep(0.05)  # the service's quorum tick is 20 ms: the others' requests are in by then

    def regroup(self, ctx: DistContext, step: int, broken: bool = True) -> DistContext:
        """Leave the current group (broken by a loss, or about to admit a rank started again), wait for
        the service's new quorum, and form the new group on its rank 0's store; returns this rank's new
        context. TimeoutError when no group forms in time."""
        self._leave(broken)
        return self._form(ctx, step)

    def check_minimum(self) -> None:
        """After a regroup: BelowMinimum when the group just formed holds fewer ranks than the launcher's
        minimum. The group is formed, so its members can still agree on the checkpoint they stop with."""
        if self.quorum is not None:
            below_minimum(self.minimum, len(self.quorum.members))

    def _leave(self, broken: bool) -> None:
        """Destroy the current group. A broken one's connections are shut down first (live/
        sockets.py): a member still waiting in its collective on this rank fails at once. The group's
        last references may sit in cycles: collected, so nothing keeps it alive."""
        if self.peers is not None:
            self.peers.unwatch()
        if broken:
            sockets.cut(self._sockets)
        held = [dist.group.WORLD] if broken and dist.is_initialized() else []  # never a local of its own
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may fail to close: it is dropped either way
            pass
        gc.collect()
        let_go(held)
        restart_group_names()

    def enter(self, ctx: DistContext) -> DistContext:
        """A rank started again (recovery.rejoin): heartbeat, ask to join (RUN_DIR/live/join-<id>, which
        the others look for at their check points), and wait in the service's quorum until they ask too;
        then this rank is a member of the live group (its state still to be taken from a peer). The
        request is written again every JOIN_RETRY_S: the others clear requests after each admission."""
        if self.pulse is not None:
            self.pulse.start()
        if self.peers is not None:
            self.peers.start()
        self.membership.start()
        request = self.fence.folder / f"{JOIN_PREFIX}{self.membership.replica_id}"
        deadline = time.monotonic() + self.quorum_timeout_s
        try:
            while True:
                rundir.write_text(request, "", durable=False)
                left = deadline - time.monotonic()
                try:
                    new = self._form(ctx, JOINING_STEP, min(JOIN_RETRY_S, max(left, 0.1)))
                    break
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise
        finally:
            request.unlink(missing_ok=True)
        if self.pulse is not None:
            self.pulse.joined()
        return new

    def needs_state(self) -> bool:
        """Whether a member of the group just formed must be sent the newest member's state: a rank
        started again, or a survivor a step behind another (membership.behind)."""
        return self.quorum is not None and bool(behind(self.quorum))

    def is_behind(self) -> bool:
        """Whether this rank is one of those (it loads the state it is sent)."""
        return self.quorum is not None and self.membership.replica_id in behind(self.quorum)

    def clear_join_requests(self) -> None:
        """Rank 0, after an admission: every request is served or stale (a joiner not yet in the quorum
        writes its own again), so none makes the group form again at the next check point."""
        for name in join_requests(self.fence.folder):
            with contextlib.suppress(OSError):
                os.unlink(self.fence.folder / name)

    def join_requested(self) -> bool:
        """Whether a rank started again asks to join (RUN_DIR/live/join-<id>): one directory read per
        check point."""
        return bool(join_requests(self.fence.folder))

    def one_host(self) -> bool:
        """Whether every member of the current group gives out its store on the same host (one machine:
        gradients may be averaged through shared memory); the same answer on every member."""
        assert self.quorum is not None
        return len({m.store_address.rsplit(":", 1)[0] for m in self.quorum.members}) == 1

    def source(self) -> int:
        """The rank whose state a joining rank takes: the first member at the newest step."""
        assert self.quorum is not None
        found = source(self.quorum)
        assert found is not None  # _form refuses a group with no state
        return found

    def _form(self, ctx: DistContext, step: int, timeout_s: float | None = None) -> DistContext:
        """The service's next quorum as this rank's process group. A member lost between the quorum
        and the group (a rank started again, SIGKILLed while it waited to be admitted) never arrives:
        after self.forming the group is left and a new quorum asked for, until `timeout_s`."""
        deadline = time.monotonic() + (timeout_s or self.quorum_timeout_s)
        while True:
            left = max(deadline - time.monotonic(), 0.1)
            quorum = self._ask(step, left)
            if source(quorum) is None:
                raise BadInput("live error: no rank of the live group is left to take the state from")
            found = twin(quorum, self.membership.replica_id) if step == JOINING_STEP else None
            if found is not None:
                raise BadInput(
                    f"live error: rank {started_as(found)} trains already in the live group (as {found}): this "
                    "launch is a second one of its node, not a replacement; it leaves without joining"
                )
            try:
                return self._enter(ctx, quorum)
            except (BadInput, FenceBusy, KeyboardInterrupt):  # the storage, the fence: no member is gone
                raise
            except Exception as e:  # a member missing or lost while the group formed
                missing = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            self._leave(broken=True)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no live group formed within {timeout_s or self.quorum_timeout_s:g} s: {missing}")
            print(
                f"live: the group of {len(quorum.members)} did not form ({missing}): a member is gone; "
                "asking the service for a new one",
                file=sys.stderr,
                flush=True,
            )

    def _ask(self, step: int, timeout_s: float) -> Quorum:
        """The service's next quorum with this run's members only: this rank asks with its store address
        sealed under the run's secret (runkey.RunKey.seal), and a member whose sealed address does not open
        (a stranger: it has no secret) is dropped at once; the others' addresses are opened."""
        me = self.membership.replica_id
        if self.key is None:
            return self.membership.quorum(step, self.store_address, timeout_s)
        found = self.membership.quorum(step, self.key.seal(me, self.store_address, step), timeout_s)
        members = []
        for m in found.members:
            address = self.key.unseal(m.replica_id, m.store_address, m.step)
            if address is not None:
                members.append(Member(m.replica_id, address, m.step))
        return Quorum(found.quorum_id, found.token, sorted_members(members))

    def _proven(self, quorum: Quorum, forming: datetime.timedelta) -> Quorum:
        """The members of `quorum` that prove they hold the run's secret for this quorum (the challenge is its
        token, new for every quorum): each member puts its answer in its own store, and reads every other
        member's from that member's store, all at once, each within `forming`. A member that cannot answer
        (a stranger replaying a member's entry, a member gone) is left out: the group forms without it, on
        a rendezvous of its own (the proven set names its store keys), so members that judged differently
        never meet in one group."""
        if self.key is None:
            return quorum
        me = self.membership.replica_id
        mine = next((m for m in quorum.members if m.replica_id == me), None)
        if mine is None or mine.store_address != self.store_address:
            raise ValueError(f"{me} is not in quorum {quorum.quorum_id} with its own store")
        self.store.set(
            answer_key(self.key, quorum.token, me), self.key.proof(quorum.token, me, self.store_address, mine.step)
        )
        others = [m for m in quorum.members if m is not mine]
        if not others:
            return quorum
        with ThreadPoolExecutor(max_workers=min(len(others), PROVE_THREADS), thread_name_prefix="tl-prove") as pool:
            verdicts = list(pool.map(lambda m: self._proves(quorum.token, m, forming), others))
        kept = [mine, *(m for m, ok in zip(others, verdicts, strict=True) if ok)]
        return Quorum(quorum.quorum_id, quorum.token, sorted_members(kept))

    def _proves(self, token: str, member: Member, forming: datetime.timedelta) -> bool:
        """Whether `member`'s store holds its answer to `token`'s challenge (waited for up to `forming`)."""
        assert self.key is not None
        try:
            relay = peer_relay(self.store_key, member.store_address)
            try:
                peer = dist.TCPStore("127.0.0.1", relay.port, is_master=False, timeout=forming)
                answer = peer.get(answer_key(self.key, token, member.replica_id))
            finally:
                relay.close()
        except Exception:  # unreachable, a bad address, no answer in time: not proven
            return False
        return self.key.proves(answer, token, member.replica_id, member.store_address, member.step)

    def _enter(self, ctx: DistContext, quorum: Quorum, forming: datetime.timedelta | None = None) -> DistContext:
        """Form the quorum's process group on its rank 0's store, recording the sockets it opened. Every
        member waits at most `forming` (self.forming unless given: the first group, formed by ranks that
        just met at a barrier, keeps dist.timeout_s) for the others; the group's collectives then get
        dist.timeout_s."""
        forming = forming or self.forming
        quorum = self._proven(quorum, forming)
        if source(quorum) is None:
            raise ValueError("no proven member of the group holds the state")
        rank, world = seat(quorum, self.membership.replica_id)
        before = set(sockets.open_sockets().values())
        leader = quorum.members[0]
        ids = [m.replica_id for m in quorum.members]
        seated = (
            self.key.hidden("group", quorum.token, *ids)  # a name a stranger writing into the store cannot know
            if self.key is not None
            else hashlib.blake2b("\x00".join(ids).encode(), digest_size=8).hexdigest()
        )
        for relay in self._relays:  # the previous group's
            relay.close()
        self._relays = []
        if rank == 0:
            store: dist.Store = self.store
        else:
            relay = peer_relay(self.store_key, leader.store_address)
            self._relays.append(relay)  # open while the group is: torch may connect again (a store's clone)
            store = dist.TCPStore("127.0.0.1", relay.port, is_master=False, timeout=forming)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"torchlaunch/live/{quorum.token}/{seated}", store),
            rank=rank,
            world_size=world,
            timeout=forming,
        )
        dist.set_timeout(self.timeout)
        self._sockets = frozenset(set(sockets.open_sockets().values()) - before)
        if self.peers is not None:
            group = self._sockets
            others = tuple(m.store_address for m in quorum.members if m.replica_id != self.membership.replica_id)
            self.peers.watch(others, lambda: sockets.cut(group))
        self.quorum = quorum
        self.membership.present()
        new = DistContext(rank, world, ctx.local_rank, ctx.local_world_size, ctx.device, "gloo")
        self.generation = self._take_generation(new)
        return new

    def _take_generation(self, ctx: DistContext) -> int:
        """Rank 0 advances the run dir's generation past the newest its members trained in (each says its
        own: a collective); every member learns it, or that the group is a superseded one's (-1: each
        raises Fenced, so its members leave together). Rank 0 keeps the generation it took at once: a
        member lost before the broadcast leaves it regrouping from that one, not fenced by its own."""
        olds = [int(g) for g in gather_json(ctx, self.generation, kinds=(int,))]  # type: ignore[call-overload]
        mine, refused = 0, None
        if ctx.is_main:
            try:
                mine = self.generation = self.fence.advance(succeeds=max(olds))
            except Fenced as e:
                mine, refused = -1, e
        generation = int(broadcast_json(ctx, mine, kinds=(int,)))  # type: ignore[call-overload]
        if refused is not None:
            raise refused
        if generation < 0:
            raise Fenced(
                f"live error: this group's members come from generation {max(olds)}, older than the run dir's: "
                "left out, this rank leaves without writing"
            )
        return generation

    def check_fence(self) -> None:
        self.fence.check(self.generation)

    def commit_guard(self) -> Callable[[], contextlib.AbstractContextManager[None]]:
        """What a checkpoint's commit is held under (store.write_checkpoint's commit_guard): this
        group's generation, taken now (a background commit may run after a regroup), checked under the
        fence's lock, which no newer group can take meanwhile."""
        generation = self.generation
        return lambda: self.fence.holding(generation)

    def stepped(self) -> None:
        """A training step done: the group is not stalled (peers.PeerWatch)."""
        if self.peers is not None:
            self.peers.stepped()

    def close(self) -> None:
        self.membership.close()
        if self.peers is not None:
            self.peers.stop()
        self.echo.close()
        self.store_front.close()
        for relay in self._relays:
            relay.close()
        if self.pulse is not None:
            self.pulse.stop()


def restart_group_names() -> None:
    """torch names the default group by a per-process counter, and its rendezvous keys carry that name;
    destroying a group sets the counter back to 0, but a group that failed to form (a member missing)
    was never made, so nothing did, and this rank's keys no longer met the others' (each retry waited
    for a name its peer never used). With no group left, the counter starts again, as the others' do."""
    if not dist.is_initialized():
        with contextlib.suppress(AttributeError):  # torch's private registry: nothing to do if it moved
            dist.distributed_c10d._world.group_count = 0


def let_go(held: list[object]) -> None:
    """Empty `held` (the last references to a broken process group) on a daemon thread, so that its
    destructor, which joins gloo's worker threads still waiting in a collective, never holds the
    caller. The caller keeps the objects in the list only, never in a name of its own."""
    if held:
        threading.Thread(target=held.clear, name="torchlaunch-let-go", daemon=True).start()


PROOF_KEY = "torchlaunch/proof"


def answer_key(key: RunKey, token: str, replica_id: str) -> str:
    """Where a member puts its answer to a quorum's challenge in its own store: named under the secret
    (RunKey.hidden), so a stranger who writes into the store cannot overwrite it (issue 52: that left the
    member out of the quorum)."""
    return f"{PROOF_KEY}/{key.hidden('answer', token, replica_id)}"


PROVE_THREADS = 32


def join_requests(folder: Path) -> list[str]:
    """The join requests in RUN_DIR/live: files named join-rejoinNNN-rankNNNNNN (nothing else counts)."""
    try:
        with os.scandir(folder) as entries:
            return [e.name for e in entries if JOIN_NAME.fullmatch(e.name)]
    except OSError:
        return []
