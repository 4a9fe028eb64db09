"""The live training group (recovery.live): a lost rank makes the others regroup in place and run the
interrupted step again; a rank started again joins at a check point and takes a peer's state.

The membership, this rank's store, the process group re-formed in place, the fence and the state's
wire are live's (group.LiveGroup, this rank's seat); what this module adds is what a regroup
does to the rank's training: the step in flight dropped, the state shared and checked, the plan's new
shares, the commit a loss may have cost saved again, and the record of each regroup.

Gradients are averaged over one flat buffer in buckets posted from backward's hooks and waited for
after it (live/grads.OverlappedGradients), not by DDP: DDP's reducer fails inside autograd when
a peer dies mid-step, and its state is lost with the group.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed
from torch import nn

from torchlaunch import config as config_mod
from torchlaunch.base.untrusted import whole
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.dist import DistContext, broadcast_json, gather_json
from torchlaunch.core.shm_reduce import SharedMemoryReducer, build_reducer
from torchlaunch.exit_codes import PREEMPTED, BadInput, ConfigError
from torchlaunch.live import minimum
from torchlaunch.live.failure import is_peer_lost
from torchlaunch.live.fence import Fenced
from torchlaunch.live.grads import FlatGradients, OverlappedGradients, average_gradients, broadcast_parameters
from torchlaunch.live.group import LiveGroup
from torchlaunch.live.handover import share_state, state_digest
from torchlaunch.live.replan import Regroup, replan
from torchlaunch.worker.metrics import WorldSize

if TYPE_CHECKING:
    from torchlaunch.worker.groups import Host
    from torchlaunch.worker.metrics import RunLog

T = TypeVar("T")

SHARED_STATE_WORLD = -1
"""The world size a state sent to a joining rank carries: no rank's RNG streams are restored from it
(the joining rank seeds fresh ones, as after any world size change)."""


def loss_line(error: BaseException) -> str:
    """The first line of a peer's loss, kept while the error itself is let go. Why the regroup runs
    after the handler, not in it: the error's traceback holds the failed collective's frames, and they
    hold the broken process group, whose gloo connections stay open while anything refers to it. A
    member still waiting in that collective on a live peer (3+ ranks: it lost no direct peer) learns
    of the loss only when those connections close: measured, it otherwise waits out dist.timeout_s."""
    return str(error).splitlines()[0][:160] if str(error) else type(error).__name__


class LiveTrainingGroup:
    """This rank's seat in the live group (live/group.LiveGroup) and what its regroups do to
    the rank's training."""

    reduces_in_backward = False
    keeps_grad_views = True  # one flat buffer (FlatGradients)
    grid_sum = None  # the grid sums over gloo: shared memory is formed per group, not per run

    def __init__(self, seat: LiveGroup) -> None:
        self.seat = seat
        self.flat: OverlappedGradients | None = None
        self.reducer: SharedMemoryReducer | None = None
        """Gradient averaging through shared memory when every member is on this machine (per group)."""
        self.regroups: list[Regroup] = []
        self.joined: dict[str, Any] | None = None
        self._since_regroup: Regroup | None = None
        """Set by a regroup until the first step on the new group is done (its time is recorded)."""

    @property
    def joining(self) -> bool:
        return self.seat.joining

    @property
    def started_as(self) -> int | None:
        return self.seat.started_as

    @property
    def generation(self) -> int | None:
        return self.seat.generation

    # ------------------------------------------------------------------ gradients

    def form(self, host: Host) -> tuple[nn.Module, str]:
        """No DDP: its reducer dies with the group. Every member starts from rank 0's parameters (a rank
        started again takes a peer's whole state instead, in start())."""
        model = host.model
        if not self.seat.joining:
            broadcast_parameters(model)
        if not FlatGradients.fits(model.parameters()):
            raise BadInput(
                "live error: recovery.live needs every trainable parameter on one device in one dtype "
                "(one flat gradient buffer); set recovery.live=false for this model"
            )
        self.flat = OverlappedGradients(model.parameters())
        return model, self._gradient_path(host)

    def _gradient_path(self, host: Host) -> str:
        """Through shared memory when every member is on this machine (built again after each regroup: a
        collective of the new group), else bucketed gloo all-reduces posted during backward
        (live/grads.OverlappedGradients).
        Every member decides alike, from the group's store hosts (a rank started again, before it joins,
        is a group of one)."""
        ctx = host.ctx
        self.reducer = None
        shared = host.cfg.dist.shared_memory_reduce and ctx.backend == "gloo"
        if ctx.world_size > 1 and shared and self.seat.one_host():
            self.reducer = build_reducer(host.model)
        how = "shared memory" if self.reducer is not None else "gloo all-reduces overlapped with backward"
        return f"live: {how}, group re-formed on a lost rank"

    def completing_backward(self, world_size: int) -> None:
        """Across machines the next backward posts the gradients' buckets as they are done; through shared
        memory (one machine) the whole buffer is averaged after it, faster than any overlap."""
        assert self.flat is not None
        if world_size > 1 and self.reducer is None:
            self.flat.arm()

    def reduce_gradients(self, world_size: int) -> None:
        """Fails here, before the optimizer step, when a peer is lost: the step can run again unchanged."""
        assert self.flat is not None
        if world_size > 1 and self.reducer is None:
            self.flat.finish(world_size)
        else:
            self.flat.discard()
            average_gradients(self.flat, world_size, self.reducer)

    def zero_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """The flat buffer is zeroed; the .grad views stay."""
        assert self.flat is not None
        self.flat.zero()

    def fence_commit(self) -> Callable[[], AbstractContextManager[None]]:
        """A rank outside the live group never commits (live/fence.py)."""
        self.seat.check_fence()
        return self.seat.commit_guard()

    # ------------------------------------------------------------------ start and end

    def start(self, host: Host) -> Path | None:
        """A rank started again (recovery.rejoin) joins the live group at the others' next check point
        and takes a peer's whole state (model, optimizer, scheduler, scaler, position), checked; the
        loader follows the plan from there. Nothing is read from a checkpoint. Any other rank resumes."""
        if not self.seat.joining:
            return host.resume()
        started = time.time()
        host.ctx = self.seat.enter(host.ctx)
        source = self.seat.source()
        self._share_state(host)
        self._regrouped(host, None, host.ctx, None, "rejoin", started, "")
        self.joined = {
            "event": "joined",
            "time": time.time(),
            "started": started,
            "step": host.progress.global_step,
            "rank": host.ctx.rank,
            "world": host.ctx.world_size,
            "source": source,
            "generation": self.seat.generation,
        }
        return None

    def opened(self, log: RunLog) -> None:
        """A rank started again: its own record of taking a peer's state."""
        if self.joined is None:
            return
        log.event(self.joined)
        j = self.joined
        print(
            f"live: joined the group at global step {j['step']} as rank {j['rank']} of {j['world']} "
            f"(state from rank {j['source']}, digest checked)",
            file=sys.stderr,
            flush=True,
        )

    def finish(self, host: Host, log: RunLog) -> None:
        """model.pt out, then a barrier, so that a rank 0 lost before its final commit or model.pt is
        noticed by the others (they regroup; the new rank 0 saves the final checkpoint, kept as is if it
        was committed, and publishes model.pt) rather than ending without either."""

        def publish() -> None:
            if host.last_saved is None:  # a regroup since the final save: it may not have been committed
                host.save(synchronous=True, validated=True, final=True)
            host._publish_final_model(log)
            torch.distributed.barrier()

        self.surviving(host, log, "checkpoint", publish)

    def below_minimum(self, host: Host, log: RunLog, below: minimum.BelowMinimum) -> int:
        """A loss left the live group below the launcher's minimum (live/minimum.py): the ranks
        left train no further step; they commit a checkpoint of the last whole step (a save that a further
        loss interrupts is taken again on the ranks left, who are still below it) and stop with 75, which
        the launcher requeues. A failed save leaves the previous checkpoint the newest."""
        while True:
            try:
                self.surviving(host, log, "checkpoint", lambda: host.save(synchronous=True))
                break
            except minimum.BelowMinimum as again:
                below = again
        p = host.progress
        line = below.committed(p.global_step)
        log.line(line)
        log.event(
            {
                "event": "below_minimum",
                "time": time.time(),
                "step": p.global_step,
                "world": host.ctx.world_size,
                "generation": self.seat.generation,
            }
        )
        minimum.last_stop, minimum.first_at_stop = line, host.ctx.is_main
        return PREEMPTED

    def close(self) -> None:
        if self.flat is not None:
            self.flat.close()
        self.seat.close()

    # ------------------------------------------------------------------ losses

    def lost(self, error: BaseException) -> str | None:
        return loss_line(error) if is_peer_lost(error) else None

    def surviving(self, host: Host, log: RunLog, during: str, attempt: Callable[[], T]) -> T:
        """`attempt()`, run again on the ranks left after each loss of a peer. Validation only reads the
        model, so it runs again whole; a checkpoint is saved again (write_checkpoint keeps a step already
        committed); an interrupted optimizer step is recover_step's."""
        while True:
            try:
                return attempt()
            except Exception as e:
                if not is_peer_lost(e):
                    raise
                why = loss_line(e)
            self._recover(host, log, why, during=during)  # outside the handler: see loss_line

    def recover_step(self, host: Host, log: RunLog, why: str, window: Any) -> None:
        """A loss mid-step: regroup and go on from the step that was interrupted (its optimizer step was
        never taken), saving again the checkpoint the loss may have cost."""
        self._recover(host, log, why, window)
        self._save_again_if_lost(host, log)

    def _recover(self, host: Host, log: RunLog, why: str, window: Any = None, during: str = "step") -> None:
        """Regroup in place: new quorum, new process group, the plan's new shares; the loader, model and
        optimizer are kept. The loss window restarts (its sum held the lost ranks' shares). A save
        interrupted on any rank is not known to be committed: the next save of that step writes it."""
        lost_at = time.time()
        old = host.ctx
        host.abandon_step()
        if self.flat is not None:
            self.flat.discard()  # the broken group's collectives, let go
        self.reducer = None  # built again on the new group (_regrouped)
        host.ctx = self.seat.regroup(old, host.progress.global_step)
        if host.ctx.is_main:  # a commit in flight was refused if it reached the fence after the regroup
            host.writer.settle(drop=Fenced)
        if self.seat.needs_state():  # a rank started again, or a survivor a step behind another
            healed = self.seat.is_behind()
            self._share_state(host)
            if healed:
                why += f"; this rank was a step behind: took rank {self.seat.source()}'s state, checked"
        self._regrouped(host, log, old, window, during, lost_at, why)
        self.seat.check_minimum()  # below the launcher's minimum: BelowMinimum, handled by fit

    def _save_again_if_lost(self, host: Host, log: RunLog) -> None:
        """After a loss mid-epoch: the last save point's checkpoint may never have been committed (rank
        0 lost while writing it, or its background commit refused by the fence: the group re-formed
        before it reached it). The new rank 0 looks for it among the committed ones and, where it is
        missing, every member saves the step it is at now (agreed by a broadcast), so a whole-job stop
        later resumes from here rather than from the save point before."""
        point = host.save_point
        newest = -1
        if host.ctx.is_main and point is not None:
            committed = ckpt.newest_committed(host.ckpt_root)
            newest = ckpt.parse_step(committed.name) or 0 if committed is not None else 0
        missing = broadcast_json(host.ctx, point is not None and 0 <= newest < point, kinds=(bool,))
        if not missing:
            return
        log.line(
            f"live: the checkpoint of step {point} was not committed before the group re-formed; "
            f"saving step {host.progress.global_step} now"
        )
        self.surviving(host, log, "checkpoint", lambda: host.save(synchronous=False))

    # ------------------------------------------------------------------ joiners

    def asks_to_join(self) -> bool:
        return self.seat.join_requested()

    def admit(self, host: Host, log: RunLog, window: Any) -> None:
        """A rank started again joins at this check point: a new group with it, this run's state sent
        to it from the first rank at the newest step (checked on every member), the plan's new shares."""
        asked_at, old = time.time(), host.ctx
        if host.ctx.is_main:  # a commit in flight ends under this group's generation, not refused by the next
            host.writer.settle()
        host.ctx = self.seat.regroup(old, host.progress.global_step, broken=False)
        if host.ctx.is_main:
            self.seat.clear_join_requests()
        if not self.seat.needs_state():  # a stale or forged request: the same ranks, nothing to send
            self._regrouped(host, None, old, window, "rejoin", asked_at, "")
            return
        self._share_state(host)
        self._regrouped(host, log, old, window, "rejoin", asked_at, "a rank started again joined")

    def stepped(self, log: RunLog, step: int) -> None:
        """A training step done: the group is not stalled (peers.PeerWatch); the first one on a new group
        is the recovery figure."""
        self.seat.stepped()
        if self._since_regroup is not None:
            log.event({"event": "stepped", "time": time.time(), "step": step})
            self._since_regroup = None

    # ------------------------------------------------------------------ a new group

    def _share_state(self, host: Host) -> None:
        """Every member of the new group: the source sends its state, each joining rank loads it, and
        all compare a digest of their model, so a rank never trains on a state that differs."""
        src = self.seat.source()
        mine = {**host.state_dict(), "world_size": SHARED_STATE_WORLD} if host.ctx.rank == src else None
        state = share_state(host.ctx, src, mine)
        saved = broadcast_json(host.ctx, host.last_saved, src=src, kinds=(list, type(None)))
        if self.seat.joining or self.seat.is_behind():
            host.load_state_dict(state)
            host.last_saved = saved_position(saved)
            self.seat.joining = False
        digests = gather_json(host.ctx, state_digest(host.model), kinds=(str,))
        if len(set(digests)) != 1:
            raise BadInput(f"live error: the members' models differ after a rank took rank {src}'s state")

    def _regrouped(
        self, host: Host, log: RunLog | None, old: DistContext, window: Any, during: str, since: float, why: str
    ) -> None:
        """After a new group formed: averaging path, plan, loader and agreement for it, and the record."""
        host.gradient_path = self._gradient_path(host)
        host.group_changed(replan(host.plan, host.ctx.rank, host.ctx.world_size), window)
        if log is None:  # a rank started again (the others' logs say it), or a regroup that changed nothing
            return
        p = host.progress
        if host.ctx.is_main and not old.is_main:
            log.promote(p.global_step)
        log.world_changed(p.global_step, p.epoch, host.world, WorldSize.of(old), host.plan)  # `status` reads it
        regroup = Regroup(
            p.global_step + 1,
            old.rank,
            old.world_size,
            host.ctx.rank,
            host.ctx.world_size,
            self.seat.generation,
            time.time() - since,
            during,
        )
        self.regroups.append(regroup)
        self._since_regroup = regroup
        log.line(f"{regroup.line()} ({why})")
        log.event({"event": "regrouped", "time": time.time(), "error_at": since, **regroup.__dict__})


def form(cfg: config_mod.RunConfig, ctx: DistContext, attempt: int = 0) -> LiveTrainingGroup:
    """The live road's group (torchlaunch.roads, "live": Road.group): this rank seated by join, every rank
    agreeing on a bad input while seating itself."""
    from torchlaunch.core.dist import agreed

    return agreed(ctx, lambda: join(cfg, ctx, attempt))


def join(cfg: config_mod.RunConfig, ctx: DistContext, attempt: int = 0) -> LiveTrainingGroup:
    """This rank's seat in the live group: the launcher's membership service, heartbeats, the first
    quorum (every rank of the launch) and the run dir's group generation. A rank started again
    (`attempt`) only gets its seat ready: it enters the group in start(), once its model and loaders
    are built, so the others never wait for its start-up."""
    from torchlaunch import contract
    from torchlaunch.live.fence import Fence
    from torchlaunch.live.group import STORE_HOST
    from torchlaunch.live.lighthouse import LighthouseMembership
    from torchlaunch.live.membership import replica_id_of
    from torchlaunch.live.minimum import from_env as minimum_from_env
    from torchlaunch.live.placement import Follow
    from torchlaunch.live.pulse import Pulse
    from torchlaunch.live.runkey import load as load_run_key

    address = contract.get(contract.LIGHTHOUSE)
    if not address:
        raise ConfigError(
            "recovery.live",
            "no membership service: this launcher does not run one",
            "launch with `python -m launch.local --gpus N` on one node, or set recovery.live=false",
        )
    # the rank the launcher started it as: a joiner's and a --nnodes MIN:MAX rank's differ from its seat
    launched = attempt or contract.get(contract.LIVE_FIRST_GROUP)
    rank = int(contract.get(contract.RANK, "0") or 0) if launched else ctx.rank
    key = load_run_key(cfg.run_dir)  # only the run's own ranks are seated (live/runkey.py)
    follow = Follow(cfg.run_dir) if contract.get(contract.LIVE_PLACED) == "1" else None
    membership = LighthouseMembership(
        address, replica_id_of(rank, attempt, key.tag), cfg.recovery.heartbeat_timeout_s, key.presence_key, follow
    )
    pulse_fd = contract.get(contract.LIVE_PULSE_FD, "")
    fd = whole(pulse_fd, 6)
    pulse = Pulse.for_bound(fd, cfg.recovery.heartbeat_timeout_s) if fd is not None else None
    host = contract.get(contract.LIVE_STORE_HOST) or STORE_HOST
    seat = LiveGroup(
        membership,
        Fence(cfg.run_dir),
        cfg.dist.timeout_s,
        cfg.recovery.quorum_timeout_s,
        host=host,
        pulse=pulse,
        heartbeat_timeout_s=cfg.recovery.heartbeat_timeout_s,
        minimum=minimum_from_env(ctx.local_world_size),
        key=key,
    )
    seat.started_as = rank
    if attempt:
        seat.joining = True
    else:
        seat.join(ctx, step=0)
    return LiveTrainingGroup(seat)


def saved_position(value: object) -> tuple[int, int, bool] | None:
    """The source's last save (Trainer.last_saved) as a rank that took its state must hold it.

    Why: save() skips a step already saved, and a checkpoint is a collective. load_state_dict marks the
    loaded step saved, which is true of a checkpoint but not of a live peer's state: a joiner that
    took it then skipped the save of that step (a stop right at its admission) while the others
    entered the save's gather, and both waited until dist.timeout_s. With the source's own record, a
    save of the step is one decision on every member."""
    if value is None:
        return None
    if (
        isinstance(value, list)
        and len(value) == 3
        and all(type(v) is int for v in value[:2])
        and type(value[2]) is bool
    ):
        return (value[0], value[1], value[2])
    raise BadInput(f"live error: a peer's last save {str(value)[:80]!r} is not [step, epoch, val_pending]")
