"""One rank's training: the model, optimizer and loaders it builds, the step, and the loop.

The loop's decisions (log, save, validate, check, stop) come from worker/schedule.py; the optimizer
and LR schedule from worker/optim.py, the precision from worker/precision.py, the run's outputs go
through worker/metrics.py and its checkpoints through core/checkpoint.py.

No step waits for the device except at check points (log points, saves, epoch ends, the last step
and an agreed preemption): the loss stays on the device in a running sum, and each step's preemption
flag is all-reduced without waiting and read a few steps later (core/preemption.py StepAgreement),
the same step on every rank. At a check point the all-reduced loss sum is read: a non-finite sum on
any rank stops every rank together (Trainer.NAN_CHECK_BOUND).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchlaunch import config as config_mod
from torchlaunch import contract, grace, rundir, status
from torchlaunch.config import RunConfig
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.dist import (
    DistContext,
    all_reduce_sum_,
    broadcast_buffers,
    broadcast_json,
    gather_json,
    ordered_allreduce_hook,
)
from torchlaunch.core.preemption import PreemptionWatcher, StepAgreement, agree
from torchlaunch.core.recovery import minimum
from torchlaunch.core.recovery.failure import is_peer_lost
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.core.shm_reduce import (
    SharedMemoryReducer,
    SharedSum,
    build_reducer,
    build_shared_sum,
    shared_memory_hook,
)
from torchlaunch.core.step_drop import StepDrop, StepDropped, applies
from torchlaunch.exit_codes import OK, PREEMPTED, BadInput, ConfigError
from torchlaunch.jobs import progress as progress_beat
from torchlaunch.jobs.progress import heartbeat
from torchlaunch.startup import process_age_s
from torchlaunch.worker import eval_loop
from torchlaunch.worker.accumulate import backward_share
from torchlaunch.worker.data import DataBundle, ImageSet, Normalizer, TrainLoader, eval_batches
from torchlaunch.worker.data.augment import val_resize_for
from torchlaunch.worker.debug import check_model_io
from torchlaunch.worker.faults import FaultSignal
from torchlaunch.worker.grid import GridStep, broadcast_model, grid_size, pin_threads
from torchlaunch.worker.lead_time import lead_time_warning
from torchlaunch.worker.lookahead import Lookahead
from torchlaunch.worker.metrics import RunLog, WorldSize, require_tensorboard
from torchlaunch.worker.models import build_model
from torchlaunch.worker.optim import build_optimizer, build_scheduler
from torchlaunch.worker.precision import (
    autocast_dtype,
    training_precision,
)
from torchlaunch.worker.schedule import LoopSchedule
from torchlaunch.worker.state_check import worker_state_problem

if TYPE_CHECKING:
    from torchlaunch.core.recovery.group import FlatGradients, LiveGroup
    from torchlaunch.core.recovery.replan import Regroup


def live_ops() -> ModuleType:
    """core/recovery/group.py (the process group re-formed in place, gradient averaging without DDP),
    imported when a run is live: live mode is off by default, and a worker that does not train live
    does not pay for its imports at start-up (`python -m bench.startup`)."""
    from torchlaunch.core.recovery import group

    return group


VERSION = "0.1.0"

AGREEMENT_LAG = 2
"""Steps between posting a preemption flag and reading the agreed value between check points: the
host never waits for the step it just queued, and a stop comes at most this many steps late."""


T = TypeVar("T")
SHARED_STATE_WORLD = -1
"""The world size a state sent to a joining rank carries: no rank's RNG streams are restored from it
(the joining rank seeds fresh ones, as after any world size change)."""


class Admitted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The group grew at a check point (a rank started again joined): the epoch's steps go on from
    the same position with the new shares (_train_epoch catches it)."""


class NonFiniteLoss(BadInput):
    """The loss became NaN/inf; a deterministic rerun would hit it again, so it counts as bad input."""


@dataclass
class Progress:
    """Where the run is: epoch, optimizer steps done in that epoch, and in total."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    val_pending: bool = False
    """The epoch's training steps are done but its validation is not (preempted during validation)."""
    best_val_acc: float | None = None
    last_val: dict[str, float] = field(default_factory=dict)

    def take(self, other: Progress) -> None:
        """Become `other` in place. Why not a new object: fit, _validate and the step loop hold this
        one in a local while a live rank a step behind loads a peer's state mid-fit; a replaced object
        left them on the old position (seen: that rank validated twice and its peer waited 300 s)."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(other, name))


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (DDP also broadcasts it); per-rank streams for anything else."""
    torch.manual_seed(seed)
    random.seed(seed * 1000 + rank)
    np.random.seed((seed * 1000 + rank) % (2**32))


def whitening_sample(images: ImageSet, normalize: Normalizer, image_size: int, limit: int = 5000) -> torch.Tensor:
    """The first `limit` training images, normalised, unaugmented: what data-dependent initialisations
    (the fastnet stem) are computed from. Same on every rank."""
    if images.images is not None:
        batch = images.images[:limit]
    else:  # per-file path (images of any size): decode a smaller sample at the training size
        batch = torch.stack([images.decode(i, image_size) for i in range(min(limit, 1000, len(images)))])
    return normalize(batch.to(normalize.scale.device)).contiguous()


class LossWindow:
    """The running loss sum of the steps since the last log point, on the device (float64: the same
    sums, bit for bit, as adding the losses up as Python floats). Read only at check points."""

    def __init__(self, device: torch.device, start_step: int) -> None:
        self.device = device
        self.reset(start_step)

    def reset(self, start_step: int) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.start_step, self.steps = start_step, 0  # the window holds the steps after start_step

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.steps += 1


def loss_line(error: BaseException) -> str:
    """The first line of a peer's loss, kept while the error itself is let go. Why the regroup runs
    after the handler, not in it: the error's traceback holds the failed collective's frames, and they
    hold the broken process group, whose gloo connections stay open while anything refers to it. A
    member still waiting in that collective on a live peer (3+ ranks: it lost no direct peer) learns
    of the loss only when those connections close: measured, it otherwise waits out dist.timeout_s."""
    return str(error).splitlines()[0][:160] if str(error) else type(error).__name__


class Trainer:
    """Builds model, optimizer, schedule and loaders for one rank, and runs fit()."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: DistContext,
        data: DataBundle,
        watcher: PreemptionWatcher,
        live: LiveGroup | None = None,
    ) -> None:
        """`live` (recovery.live with a process group): a lost rank makes the others regroup in place
        (self._recover) instead of failing; gradients are then averaged by core.recovery.group, not DDP."""
        self.cfg, self.ctx, self.data, self.watcher, self.live = cfg, ctx, data, watcher, live
        self.device = ctx.device
        if cfg.train.tensorboard:
            require_tensorboard()  # fail on every rank together, before any collective
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = rundir.checkpoints(self.run_dir)
        self.precision = training_precision(cfg, ctx, data)
        self.amp_dtype = autocast_dtype(self.precision)
        self.grid = grid_size(cfg.train)  # train.exact: micro-batches per step (worker/grid.py), 0 = off
        if self.grid:
            pin_threads(self.device)
        self.plan = BatchPlan(
            len(data.train),
            cfg.train.batch_size,
            cfg.seed,
            ctx.rank,
            ctx.world_size,
            cfg.train.micro_batch_size,
            cfg.data.crop_padding,
            cfg.data.flip,
            cfg.data.pad_mode,
            cutout=cfg.data.cutout,
            image_size=data.image_size,
            train_crop=cfg.data.train_crop,
            grid=self.grid,
        )
        total = self.plan.steps_per_epoch * cfg.train.epochs
        self.total_steps = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        self.schedule = LoopSchedule(
            steps_per_epoch=self.plan.steps_per_epoch,
            epochs=cfg.train.epochs,
            total_steps=self.total_steps,
            log_every=cfg.train.log_every_steps,
            save_every_steps=cfg.checkpoint.every_steps,
            save_every_epochs=cfg.checkpoint.every_epochs,
            agreement_lag=AGREEMENT_LAG,
        )

        seed_everything(cfg.seed, ctx.rank)
        model = build_model(cfg.model.name, data.num_classes, cfg.model.width).to(self.device)
        self.memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
        normalize = Normalizer(data.mean, data.std, self.device, cfg.train.channels_last)
        self.normalize = normalize
        if hasattr(model, "init_from_data"):  # data-dependent init; a resume overwrites it anyway
            model.init_from_data(whitening_sample(data.train, normalize, data.image_size))
        from torchlaunch.worker import init_from as init_weights
        from torchlaunch.worker import plugins

        init_weights.init_for_run(
            model, cfg.model.init_from, cfg.model.init_strict, cfg.checkpoint.resume, self.ckpt_root, ctx.is_main
        )  # a fresh run only; after the data init
        self.plugins = plugins.origins(cfg.model.name, cfg.data.name)  # stored so evaluate finds them
        model = model.to(memory_format=self.memory_format)
        if cfg.debug.check_model:
            self._check_model(model)
        self.model = model
        self.optimizer = build_optimizer(cfg, model, self.device)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.plan.steps_per_epoch, self.total_steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.net: nn.Module = model
        self.gradient_path = "local"
        self.live_reducer: SharedMemoryReducer | None = None
        self.flat_grads: FlatGradients | None = None
        grid_shared: SharedSum | None = None
        if live is not None:  # no DDP: its reducer dies with the group (core/recovery/group.py)
            if not live.joining:  # a rank started again takes a peer's whole state instead (fit)
                live_ops().broadcast_parameters(model)
            if not live_ops().FlatGradients.fits(model.parameters()):
                raise BadInput(
                    "live error: recovery.live needs every trainable parameter on one device in one dtype "
                    "(one flat gradient buffer); set recovery.live=false for this model"
                )
            self.flat_grads = live_ops().FlatGradients(model.parameters())
            self.gradient_path = self._live_gradient_path()
        elif ctx.distributed and self.grid:  # no DDP: the grid sums its gradients itself
            broadcast_model(model)
            grid_shared = self._grid_shared_sum(model)
            how = "shared memory" if grid_shared is not None else "all-reduce"
            self.gradient_path = f"exact grid, {self.grid} x {self.plan.micro} samples, fixed-point {how}"
        elif ctx.distributed:
            self.net = DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
            self.gradient_path = self._choose_gradient_path(self.net, model)
        if cfg.model.compile:
            self.net = torch.compile(self.net)
        self.grid_step = (
            GridStep(self.net, self.grid, cfg.seed, ctx.distributed, live is not None, grid_shared)
            if self.grid
            else None
        )
        self.lookahead = (
            Lookahead(model, cfg.optim.lookahead_every, cfg.optim.lookahead_decay, self.total_steps)
            if cfg.optim.lookahead_every
            else None
        )
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
        self.val_resize = val_resize_for(data.image_size, cfg.data.val_resize, cfg.data.train_crop)
        self.loader = TrainLoader(
            data.train,
            self.plan,
            normalize,
            self.device,
            cfg.data.augment,
            cfg.data.num_workers,
            data.image_size,
            trace=cfg.debug.trace_batches,
            val_resize=self.val_resize,
            decode=cfg.data.decode,
        )
        self.progress = Progress()
        self.world = WorldSize.of(ctx)
        self.saved_world: WorldSize | None = None  # what the loaded checkpoint was written on
        # a rank started again (recovery.rejoin) never fires the fault hook its first process fired
        self.fault = FaultSignal.from_env(ctx.rank) if live is None or not live.joining else FaultSignal(None, 0)
        self._joined: dict[str, Any] | None = None
        """A rank started again: its joining record, written once its log exists (fit)."""
        self.writer = ckpt.AsyncWriter()
        self.snapshots = ckpt.SnapshotBuffers()  # reused between async saves (no fresh pages per save)
        self.last_saved: tuple[int, int, bool] | None = None
        self.save_point: int | None = None
        """The step of the last save asked for: after a regroup, rank 0 checks it was committed."""
        self.save_seconds: float | None = None
        self.agreement: StepAgreement | None = None
        self.step_drop = self._step_drop()
        self.regroups: list[Regroup] = []
        self._since_regroup: Regroup | None = None
        """Set by a regroup until the first step on the new group is done (its time is recorded)."""

    # ------------------------------------------------------------------ start-up checks

    def _choose_gradient_path(self, net: DistributedDataParallel, model: nn.Module) -> str:
        """How DDP averages gradients. gloo on one machine: through shared memory (train/shm_reduce.py);
        gloo across machines: its all-reduce, in rank order above two ranks (bit-exact resume at any
        world size); NCCL: its own all-reduce. Every rank decides together (a collective)."""
        ctx = self.ctx
        if ctx.backend != "gloo":
            return ctx.backend or "local"
        if self.cfg.dist.shared_memory_reduce and 1 < ctx.world_size == ctx.local_world_size:
            reducer = build_reducer(model)
            if reducer is not None:
                net.register_comm_hook(reducer, shared_memory_hook)
                return "shared memory"
        if ctx.world_size > 2:  # two ranks sum a+b in any order: already exact
            net.register_comm_hook(None, ordered_allreduce_hook)
            return "gloo, rank order"
        return "gloo"

    def _grid_shared_sum(self, model: nn.Module) -> SharedSum | None:
        """train.exact's sum over ranks through shared memory when every rank is on this CPU machine
        (the same bits as gloo's all-reduce, core/shm_reduce.SharedSum); decided together."""
        ctx = self.ctx
        local = self.device.type == "cpu" and 1 < ctx.world_size == ctx.local_world_size
        if not (self.cfg.dist.shared_memory_reduce and ctx.backend == "gloo" and local):
            return None
        return build_shared_sum(model)

    def _live_gradient_path(self) -> str:
        """Live mode's gradient averaging on the current group: through shared memory when every rank
        is on this machine (built again after each regroup: a collective of the new group), else one
        flat gloo all-reduce (core/recovery/group.average_gradients). Every member decides alike, from
        the group's store hosts (a rank started again, before it joins, is a group of one)."""
        ctx = self.ctx
        self.live_reducer = None
        shared = self.cfg.dist.shared_memory_reduce and ctx.backend == "gloo"
        if ctx.world_size > 1 and shared and self.live is not None and self.live.one_host():
            self.live_reducer = build_reducer(self.model)
        how = "shared memory" if self.live_reducer is not None else "one flat gloo all-reduce"
        return f"live: {how}, group re-formed on a lost rank"

    def _step_drop(self) -> StepDrop | None:
        """How a stop mid-step drops the step in flight (core/step_drop.py), where it can."""
        if not applies(self.ctx):
            return None
        from torchlaunch import compat

        store = compat.default_store() if self.ctx.distributed else None
        return StepDrop(self.ctx, self.model, lambda: self.watcher.requested, store)

    def _check_model(self, model: nn.Module) -> None:
        """One fake batch through the model: shape and device mistakes become one clear line."""
        shape = (3, self.data.image_size, self.data.image_size)
        check_model_io(model, shape, self.data.num_classes, self.device, memory_format=self.memory_format)

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit for bit; the Checkpointer adds every rank's RNG states,
        the step and the world size (ckpt.ENVELOPE)."""
        p = self.progress
        return {
            "format_version": ckpt.FORMAT_VERSION,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "lookahead": self.lookahead.state_dict() if self.lookahead is not None else None,
            "progress": {
                "epoch": p.epoch,
                "step_in_epoch": p.step_in_epoch,
                "global_step": p.global_step,
                "samples_in_epoch": p.step_in_epoch * self.plan.global_batch,
                "val_pending": p.val_pending,
                "best_val_acc": p.best_val_acc,
                "last_val": dict(p.last_val),
            },
            "global_batch": self.plan.global_batch,
            "grid": self.grid,
            "topology": {"nodes": self.world.nodes},  # the world size itself is in the envelope
            "classes": list(self.data.classes),
            "plugins": self.plugins,
            "norm": {"mean": list(self.data.mean), "std": list(self.data.std)},
            "config": config_mod.to_dict(self.cfg),
            "versions": {"torchlaunch": VERSION},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a loaded checkpoint (the envelope included: its RNG states and world size)."""
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise BadInput(
                f"checkpoint error: the checkpoint's model does not match model.name="
                f"{self.cfg.model.name}: {str(e).splitlines()[0]} (resume with the config it was "
                f"saved with, or start a new run_dir)"
            ) from None
        saved_optim = (state.get("config") or {}).get("optim", {}).get("name")
        if saved_optim is not None and saved_optim != self.cfg.optim.name:
            raise ConfigError(
                "optim.name",
                f"the checkpoint was trained with optim.name={saved_optim}, now {self.cfg.optim.name}",
                f"resume with optim.name={saved_optim}, or start a new run_dir (model.init_from= keeps the weights)",
            )
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise ConfigError(
                "optim",
                f"the checkpoint's optimizer state does not fit optim.name={self.cfg.optim.name} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})",
                "resume with the config it was saved with, or start a new run_dir",
            ) from None
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.lookahead is not None:
            if state.get("lookahead") is None:
                raise ConfigError(
                    "optim.lookahead_every",
                    "the checkpoint was saved without lookahead",
                    "resume with the config it was saved with, or start a new run_dir",
                )
            self.lookahead.load_state_dict(state["lookahead"])
        pr = state["progress"]
        if state.get("global_batch") != self.plan.global_batch:
            raise ConfigError(
                "train.batch_size",
                f"the checkpoint was trained with a global batch of {state.get('global_batch')}, "
                f"now {self.plan.global_batch}",
                "keep the global batch; change train.micro_batch_size to fit memory instead",
            )
        if state.get("grid", 0) != self.grid:
            raise ConfigError(
                "train.exact",
                f"the checkpoint was trained with {state.get('grid', 0)} grid micro-batches per step "
                f"(0 = train.exact off), now {self.grid}",
                "resume with the train.exact and train.grid_micro_batches it was saved with",
            )
        self.progress.take(
            Progress(
                pr["epoch"],
                pr["step_in_epoch"],
                pr["global_step"],
                pr["val_pending"],
                pr["best_val_acc"],
                dict(pr["last_val"]),
            )
        )
        if not ckpt.restore_rank_rng(state, self.ctx):
            # a new world size has new ranks: derive fresh per-rank streams deterministically
            seed_everything(self.cfg.seed + pr["global_step"], self.ctx.rank)
        saved_nodes = (state.get("topology") or {}).get("nodes") if isinstance(state.get("topology"), dict) else None
        known = type(saved_nodes) is int and saved_nodes >= 1
        self.saved_world = WorldSize(state["world_size"], saved_nodes if known else None)
        self.last_saved = (pr["global_step"], pr["epoch"], pr["val_pending"])

    def resume(self) -> Path | None:
        """Load the checkpoint checkpoint.resume names (rank 0 picks; every rank reads the same folder)."""
        checkpointer = ckpt.Checkpointer(
            self.ctx,
            self.ckpt_root,
            self.cfg.checkpoint.keep,
            ckpt.WORKER_KIND,
            writer=self.writer,
            check_state=worker_state_problem,
        )
        loaded = checkpointer.load_latest(self.cfg.checkpoint.resume, restore=False)
        if loaded is None:
            return None
        if loaded.kind != ckpt.WORKER_KIND:
            raise BadInput(
                f"checkpoint error: {loaded.path} was written by {loaded.kind}, not the built-in worker "
                "(resume the program that wrote it, or use another run_dir)"
            )
        self.load_state_dict(loaded.state)
        return loaded.path

    def save(self, synchronous: bool, validated: bool = False, final: bool = False) -> None:
        """Every rank joins (RNG gather, agreed failure); rank 0 writes. Periodic saves go to the background.

        A checkpoint of the same step is rewritten only when validation has run since (the state
        saved by a preemption during validation is superseded by the validated one). `final`: training
        is over, so the live tensors are committed in the background without a snapshot copy while the
        caller writes model.pt, and the caller waits for the commit (self.writer)."""
        p = self.progress
        position = (p.global_step, p.epoch, p.val_pending)
        if self.last_saved == position:
            return
        replace = self.last_saved is not None and self.last_saved[0] == p.global_step
        self.last_saved = position
        self.save_point = p.global_step
        if self.live is not None:  # a rank outside the live group never commits (core/recovery/fence.py)
            self.live.check_fence()
        meta = {
            "epoch": p.epoch,
            "step_in_epoch": p.step_in_epoch,
            "val_pending": p.val_pending,
        }
        if validated:
            meta.update(p.last_val)
        checkpointer = ckpt.Checkpointer(
            self.ctx,
            self.ckpt_root,
            self.cfg.checkpoint.keep,
            ckpt.WORKER_KIND,
            writer=self.writer,
            snapshots=self.snapshots,
        )
        background = self.cfg.checkpoint.async_save and not synchronous
        info = checkpointer.save(
            p.global_step,
            self.state_dict() if self.ctx.is_main else {},  # only rank 0's payload is written
            meta,
            synchronous=not (background or (final and self.cfg.checkpoint.async_save)),
            final=final,
            replace=replace,
            commit_guard=self.live.commit_guard() if self.live is not None else None,
        )
        if info is not None:
            self.save_seconds = info.seconds

    # ------------------------------------------------------------------ steps

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the rank's weighted loss sum (its
        share's mean loss x share x W / B, worker/accumulate.py) as a 0-d float32 tensor on the device,
        unread: reading it would wait for the step, so the loop adds it to a running sum on the device
        that it reads only at check points. Summed over the ranks it is W x the global batch's mean."""
        self.net.train()
        drop = self.step_drop
        if drop is not None:
            drop.begin(self.progress.global_step + 1)
        if self.grid_step is not None:  # train.exact: summed already, the same bits on any world size
            total = self._grid_share(micro_batches, drop)
        else:
            total = backward_share(
                self.net,
                micro_batches,
                self.criterion,
                self.plan,
                self.scaler,
                self.autocast,
                leave=drop.leave if drop is not None else None,
                sync_last=self.ctx.distributed and self.live is None,  # DDP's collectives are in the last one
            )
            if self.live is not None:  # fails here, before the optimizer step, when a peer is lost
                assert self.flat_grads is not None
                live_ops().average_gradients(self.flat_grads, self.ctx.world_size, self.live_reducer)
            if drop is not None and drop.agreed():  # every rank alike: nothing of the step is applied
                drop.restore()
                self.zero_gradients()
                raise StepDropped
        if self.cfg.train.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.zero_gradients()
        self.scheduler.step()
        return total

    def _grid_share(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], drop: StepDrop | None
    ) -> torch.Tensor:
        """train.exact's step (worker/grid.py): this rank's micro-batches, then the grid's sums. A stop is
        agreed after the first collective, as backward_share's is after DDP's (core/step_drop.py).
        Returns the local loss sum x W / G, which the ranks' sums add up to W x the global mean."""
        grid = self.grid_step
        assert grid is not None
        first = self.plan.grid_range().start
        grid.distributed = self.ctx.distributed  # live mode: the group re-formed, of any size
        leave = drop.leave if drop is not None else None
        total = grid.run(
            micro_batches, first, self.progress.global_step + 1, self.criterion, self.scaler.scale, self.autocast, leave
        )
        grid.agree()
        if drop is not None and drop.agreed():
            grid.discard()
            drop.restore()
            self.zero_gradients()
            raise StepDropped
        grid.finish()
        return total * (self.ctx.world_size / self.grid)

    def zero_gradients(self) -> None:
        """After a step: live mode zeroes its flat buffer (the .grad views stay); else .grad = None."""
        if self.flat_grads is not None:
            self.flat_grads.zero()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def evaluate(self, tta: str = "none") -> dict[str, float] | None:
        """Loss and top-1 over the validation set, each sample counted once; None if preempted."""
        self.net.eval()
        broadcast_buffers(self.ctx, self.model)  # evaluate exactly the model a checkpoint holds
        batch = max(self.plan.micro, 256)
        batches = eval_batches(
            self.data.val,
            self.ctx.rank,
            self.ctx.world_size,
            batch,
            self.normalize,
            self.device,
            self.data.image_size,
            0,
            self.val_resize,
        )
        n_batches = math.ceil(max(1, len(self.data.val) // self.ctx.world_size + 1) / batch)

        def stop(i: int) -> bool:  # one agreement round per batch, the same number on every rank
            if agree(self.ctx, self.watcher.requested)[0]:
                return True
            if i == 0:
                self.fault("val", self.progress.epoch)
            return False

        result = eval_loop.evaluate(self.model, batches, self.ctx, self.autocast, tta, n_batches + 1, stop)
        if result is None:
            return None
        count = result["samples"]
        return {"val_loss": result["loss"], "val_acc": result["correct"] / count, "val_samples": count}

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        """Train to the end (OK, model.pt written) or to an agreed preemption (PREEMPTED, checkpoint
        committed). Every rank runs the same decisions (self.schedule), so collectives line up."""
        resumed = self.resume() if self.live is None or not self.live.joining else self._enter_live()
        p = self.progress
        log = RunLog(
            self.run_dir,
            self.ctx.rank,
            epochs=self.cfg.train.epochs,
            steps_per_epoch=self.plan.steps_per_epoch,
            total_steps=self.total_steps,
            global_batch=self.plan.global_batch,
            start_step=p.global_step,
            resume_step=p.global_step if resumed or self._joined else None,  # a joiner appends
            tensorboard=self.cfg.train.tensorboard,
            trace=self.cfg.debug.trace_batches,
            started_as=self.live.started_as if self.live is not None else None,  # names this rank's files
            world_size=self.ctx.world_size if resumed else None,  # a joiner leaves the others' files alone
        )
        try:
            if self._joined is not None:  # a rank started again: its own record of taking a peer's state
                log.event(self._joined)
                print(
                    f"live: joined the group at global step {p.global_step} as rank {self.ctx.rank} of "
                    f"{self.ctx.world_size} (state from rank {self._joined['source']}, digest checked)",
                    file=sys.stderr,
                    flush=True,
                )
            log.line(self._opening_line(resumed))
            if self.loader.worker_note and self.ctx.is_main:
                log.line(self.loader.worker_note)
            if resumed and self.saved_world is not None and self.saved_world != self.world:
                log.world_changed(p.global_step, p.epoch, self.world, self.saved_world, self.plan)
            if self.ctx.is_main:
                ckpt.clean_stale(self.ckpt_root)
            self._warn_lead_time(log)
            log.begin()
            window, self.agreement = LossWindow(self.device, p.global_step), StepAgreement(self.ctx)
            first_step = True
            while self.schedule.training(p.epoch, p.global_step, p.val_pending):
                if not p.val_pending:
                    if not self._train_epoch(log, window, first_step):
                        return self._preempted(log)
                    first_step = False
                    p.val_pending = True
                if not self._validate(log):
                    return self._preempted(log)
            if self.live is None:
                self._publish_final_model(log)
            else:
                self._surviving(log, "checkpoint", lambda: self._publish_with_peers(log))
            return OK
        except minimum.BelowMinimum as below:
            return self._below_minimum(log, below)
        finally:
            try:
                self.writer.wait()
            finally:
                log.close()

    def _train_epoch(self, log: RunLog, window: LossWindow, first_step: bool) -> bool:
        """The epoch's remaining training steps; False when the ranks agreed to stop (preemption). In
        live mode a lost peer's transport error makes the ranks left regroup and go on from the step
        that was interrupted (its optimizer step was never taken: _recover)."""
        while True:
            try:
                return self._train_steps(log, window, first_step)
            except Admitted:  # the group grew at a check point: the steps go on with the new shares
                first_step = False
                continue
            except Exception as e:
                if self.live is None or not is_peer_lost(e):
                    raise
                why = loss_line(e)
            self._recover(log, why, window)  # outside the handler: see loss_line
            self._save_again_if_lost(log)
            first_step = False

    def _surviving(self, log: RunLog, during: str, attempt: Callable[[], T]) -> T:
        """`attempt()`, run again on the ranks left after each loss of a peer (live mode). Validation
        only reads the model, so it runs again whole; a checkpoint is saved again (write_checkpoint
        keeps a step already committed); an interrupted optimizer step is _train_epoch's."""
        while True:
            try:
                return attempt()
            except Exception as e:
                if self.live is None or not is_peer_lost(e):
                    raise
                why = loss_line(e)
            self._recover(log, why, during=during)  # outside the handler: see loss_line

    def _recover(self, log: RunLog, why: str, window: LossWindow | None = None, during: str = "step") -> None:
        """Regroup in place: new quorum, new process group, the plan's new shares; the loader, model and
        optimizer are kept. The loss window restarts (its sum held the lost ranks' shares). A save
        interrupted on any rank is not known to be committed: the next save of that step writes it."""
        assert self.live is not None
        lost_at = time.time()
        old = self.ctx
        self.last_saved = None
        self.zero_gradients()  # the interrupted step's partial gradients
        self.agreement.forget()
        self.live_reducer = None  # built again on the new group (_regrouped)
        self.ctx = self.live.regroup(old, self.progress.global_step)
        if self.ctx.is_main:  # a commit in flight was refused if it reached the fence after the regroup
            from torchlaunch.core.recovery.fence import Fenced

            self.writer.settle(drop=Fenced)
        if self.live.needs_state():  # a rank started again, or a survivor a step behind another
            healed = self.live.is_behind()
            self._share_state()
            if healed:
                why += f"; this rank was a step behind: took rank {self.live.source()}'s state, checked"
        self._regrouped(log, old, window, during, lost_at, why)
        self.live.check_minimum()  # below the launcher's minimum: BelowMinimum, handled by fit

    def _below_minimum(self, log: RunLog, below: minimum.BelowMinimum) -> int:
        """A loss left the live group below the launcher's minimum (core/recovery/minimum.py): the ranks
        left train no further step; they commit a checkpoint of the last whole step (a save that a further
        loss interrupts is taken again on the ranks left, who are still below it) and stop with 75, which
        the launcher requeues. A failed save leaves the previous checkpoint the newest."""
        while True:
            try:
                self._surviving(log, "checkpoint", lambda: self.save(synchronous=True))
                break
            except minimum.BelowMinimum as again:
                below = again
        p = self.progress
        line = below.committed(p.global_step)
        log.line(line)
        assert self.live is not None
        log.event(
            {
                "event": "below_minimum",
                "time": time.time(),
                "step": p.global_step,
                "world": self.ctx.world_size,
                "generation": self.live.generation,
            }
        )
        minimum.last_stop, minimum.first_at_stop = line, self.ctx.is_main
        return PREEMPTED

    def _save_again_if_lost(self, log: RunLog) -> None:
        """After a loss mid-epoch: the last save point's checkpoint may never have been committed (rank
        0 lost while writing it, or its background commit refused by the fence: the group re-formed
        before it reached it). The new rank 0 looks for it among the committed ones and, where it is
        missing, every member saves the step it is at now (agreed by a broadcast), so a whole-job stop
        later resumes from here rather than from the save point before."""
        point = self.save_point
        newest = -1
        if self.ctx.is_main and point is not None:
            committed = ckpt.newest_committed(self.ckpt_root)
            newest = ckpt.parse_step(committed.name) or 0 if committed is not None else 0
        missing = broadcast_json(self.ctx, point is not None and 0 <= newest < point, kinds=(bool,))
        if not missing:
            return
        log.line(
            f"live: the checkpoint of step {point} was not committed before the group re-formed; "
            f"saving step {self.progress.global_step} now"
        )
        self._surviving(log, "checkpoint", lambda: self.save(synchronous=False))

    def _admit(self, log: RunLog, window: LossWindow) -> None:
        """A rank started again joins at this check point: a new group with it, this run's state sent
        to it from the first rank at the newest step (checked on every member), the plan's new shares."""
        assert self.live is not None
        asked_at, old = time.time(), self.ctx
        if self.ctx.is_main:  # a commit in flight ends under this group's generation, not refused by the next
            self.writer.settle()
        self.ctx = self.live.regroup(old, self.progress.global_step, broken=False)
        if self.ctx.is_main:
            self.live.clear_join_requests()
        if not self.live.needs_state():  # a stale or forged request: the same ranks, nothing to send
            self._regrouped(None, old, window, "rejoin", asked_at, "")
            return
        self._share_state()
        self._regrouped(log, old, window, "rejoin", asked_at, "a rank started again joined")

    def _enter_live(self) -> None:
        """A rank started again (recovery.rejoin): join the live group at the others' next check point
        and take a peer's whole state (model, optimizer, scheduler, scaler, position), checked; the
        loader follows the plan from there. Nothing is read from a checkpoint."""
        assert self.live is not None
        started = time.time()
        self.ctx = self.live.enter(self.ctx)
        source = self.live.source()
        self._share_state()
        self._regrouped(None, self.ctx, None, "rejoin", started, "")
        self._joined = {
            "event": "joined",
            "time": time.time(),
            "started": started,
            "step": self.progress.global_step,
            "rank": self.ctx.rank,
            "world": self.ctx.world_size,
            "source": source,
            "generation": self.live.generation,
        }

    def _share_state(self) -> None:
        """Every member of the new group: the source sends its state, each joining rank loads it, and
        all compare a digest of their model, so a rank never trains on a state that differs."""
        assert self.live is not None
        src = self.live.source()
        mine = {**self.state_dict(), "world_size": SHARED_STATE_WORLD} if self.ctx.rank == src else None
        state = live_ops().share_state(self.ctx, src, mine)
        if self.live.joining or self.live.is_behind():
            self.load_state_dict(state)
            self.live.joining = False
        digests = gather_json(self.ctx, live_ops().state_digest(self.model), kinds=(str,))
        if len(set(digests)) != 1:
            raise BadInput(f"live error: the members' models differ after a rank took rank {src}'s state")

    def _regrouped(
        self, log: RunLog | None, old: DistContext, window: LossWindow | None, during: str, since: float, why: str
    ) -> None:
        """After a new group formed: averaging path, plan, loader and agreement for it, and the record."""
        from torchlaunch.core.recovery.replan import Regroup, replan

        assert self.live is not None
        p = self.progress
        self.gradient_path = self._live_gradient_path()
        self.step_drop = self._step_drop()  # the new group's store: a lost peer's word stays in the old one
        self.plan = replan(self.plan, self.ctx.rank, self.ctx.world_size)
        self.loader.plan = self.plan
        self.world = WorldSize.of(self.ctx)
        self.agreement = StepAgreement(self.ctx)
        if window is not None:
            window.reset(p.global_step)
        if log is None:  # a rank started again (the others' logs say it), or a regroup that changed nothing
            return
        if self.ctx.is_main and not old.is_main:
            log.promote(p.global_step)
        log.world_changed(p.global_step, p.epoch, self.world, WorldSize.of(old), self.plan)  # `status` reads it
        regroup = Regroup(
            p.global_step + 1,
            old.rank,
            old.world_size,
            self.ctx.rank,
            self.ctx.world_size,
            self.live.generation,
            time.time() - since,
            during,
        )
        self.regroups.append(regroup)
        self._since_regroup = regroup
        log.line(f"{regroup.line()} ({why})")
        log.event({"event": "regrouped", "time": time.time(), "error_at": since, **regroup.__dict__})

    def _train_steps(self, log: RunLog, window: LossWindow, first_step: bool) -> bool:
        p = self.progress
        agreement = self.agreement
        assert agreement is not None
        perm = self.plan.permutation(p.epoch) if log.tracing else None
        for step, micro in self.loader.epoch(p.epoch, p.step_in_epoch):
            if perm is not None:  # debug.trace_batches: host-side indices, no device read
                indices = self.plan.rank_step(perm, p.epoch, step)[0].tolist()
                generation = self.live.generation if self.live is not None else None
                log.trace(p.global_step + 1, p.epoch, self.ctx.world_size, indices, self.loader.step_trace, generation)
            started = time.perf_counter() if first_step else 0.0
            try:
                window.add(self.train_step(micro))
            except StepDropped:
                log.line(f"stop: dropped step {p.global_step + 1} in flight; committing step {p.global_step}")
                return False
            p.step_in_epoch, p.global_step = step + 1, p.global_step + 1
            if self.live is not None:
                self.live.stepped()
            if self._since_regroup is not None:  # the first step on the new group: the recovery figure
                log.event({"event": "stepped", "time": time.time(), "step": p.global_step})
                self._since_regroup = None
            heartbeat(p.global_step, total=self.total_steps, epoch=p.epoch, samples_per_step=self.plan.per_rank)
            if self.lookahead is not None:
                self.lookahead.after_step(p.global_step)
            if first_step:  # one device sync, once per process: the start-up figure
                log.startup(p.global_step, p.epoch, self._startup_seconds(), time.perf_counter() - started)
                first_step = False
            log.stepped()
            self.fault("step", p.global_step)
            agreement.post(p.global_step, self.watcher.requested)
            plan = self.schedule.after_step(p.global_step, p.step_in_epoch)
            stop = agreement.read(self.schedule.agreement_through(p.global_step, plan.check))
            if plan.check or stop:  # before any log line, checkpoint or validation (NAN_CHECK_BOUND)
                stop = agreement.read(p.global_step) or stop
                loss_sum, join = self._agreed_loss_sum(window.total, window.start_step)
            if plan.log:
                lr = self.scheduler.get_last_lr()[0]
                mean = loss_sum / (window.steps * self.ctx.world_size)
                log.train(p.global_step, p.epoch, p.step_in_epoch, window.steps, mean, lr)
                window.reset(p.global_step)
            if stop:  # after the epoch's (or run's) last step its validation is what remains
                p.val_pending = plan.epoch_end or plan.last
                return False
            if plan.save:
                self.save(synchronous=False)
                self.fault("save", p.global_step)
            if plan.last:
                break
            if plan.check and join:  # a rank started again waits to join (recovery.rejoin)
                if agreement.drain():  # a stop posted meanwhile wins: the joiner is stopped with the job
                    p.val_pending = plan.epoch_end
                    return False
                self._admit(log, window)
                raise Admitted
        return True

    def _validate(self, log: RunLog) -> bool:
        """The pending validation of this epoch, then the epoch's end (periodic or final checkpoint);
        False when the ranks agreed to stop during it."""
        p = self.progress
        tta = self.cfg.train.tta if self.schedule.final_validation(p.epoch, p.global_step, p.step_in_epoch) else "none"
        val = self._surviving(log, "validation", lambda: self.evaluate(tta))
        if val is None:
            return False
        if tta != "none":
            val["tta"] = tta
        p.last_val = {k: v for k, v in val.items() if k not in ("val_samples", "tta")}
        if p.best_val_acc is None or val["val_acc"] > p.best_val_acc:
            p.best_val_acc = val["val_acc"]
        log.validation(p.global_step, p.epoch, val)
        p.val_pending = False
        end = self.schedule.after_validation(p.epoch, p.global_step, p.step_in_epoch)
        if end.finished_epoch:
            p.epoch, p.step_in_epoch = p.epoch + 1, 0
        if end.done:
            self._surviving(log, "checkpoint", lambda: self.save(synchronous=True, validated=True, final=True))
        elif end.save:
            self._surviving(log, "checkpoint", lambda: self.save(synchronous=False, validated=True))
            self.fault("save", p.global_step)
        return True

    def _publish_with_peers(self, log: RunLog) -> None:
        """Live mode's end: model.pt out, then a barrier, so that a rank 0 lost before its final commit
        or model.pt is noticed by the others (they regroup; the new rank 0 saves the final checkpoint,
        kept as is if it was committed, and publishes model.pt) rather than ending without either."""
        if self.last_saved is None:  # a regroup since the final save: it may not have been committed
            self.save(synchronous=True, validated=True, final=True)
        self._publish_final_model(log)
        torch.distributed.barrier()

    def _publish_final_model(self, log: RunLog) -> None:
        """model.pt appears only once the final checkpoint is committed; written while it commits."""
        staged = self._stage_final_model() if self.ctx.is_main else None
        try:
            self.writer.wait()
        except BaseException:
            if staged is not None:
                staged.unlink(missing_ok=True)
            raise
        if staged is not None:
            rundir.publish(staged, rundir.model(self.run_dir))
            p = self.progress
            log.line(
                f"finished: {p.global_step} steps, final validation top-1 "
                f"{p.last_val.get('val_acc', float('nan')):.4f}; model saved to {rundir.model(self.run_dir)}"
            )

    def _opening_line(self, resumed: Path | None) -> str:
        p = self.progress
        if resumed:  # epochs counted from 1, as the progress lines count them
            return (
                f"resumed from {resumed} at epoch {p.epoch + 1}/{self.cfg.train.epochs} step {p.step_in_epoch}/"
                f"{self.plan.steps_per_epoch} (global step {p.global_step})"
            )
        size = self.cfg.data.image_size
        return (
            f"starting {self.cfg.model.name} on {self.ctx.world_size} x {self.device.type} "
            f"({self.precision}) at {size}x{size} px (data.image_size), "
            f"{self.plan.steps_per_epoch} steps/epoch x {self.cfg.train.epochs} "
            f"epochs, global batch {self.plan.global_batch} ({self.plan.shares_text()}, accumulation "
            f"{self.plan.accumulation}), "
            f"gradients: {self.gradient_path}"
        )

    NAN_CHECK_BOUND = (
        "a non-finite training loss stops the run (exit 2) at the first check point after it: "
        "the next log point (every train.log_every_steps steps), checkpoint, preemption or end of "
        "the epoch, whichever comes first; never after a checkpoint or validation of that state"
    )
    """The finite check reads the running loss sum, which waits for the device: only at check points."""

    def _agreed_loss_sum(self, window_loss: torch.Tensor, window_from: int) -> tuple[float, bool]:
        """Every rank's loss sum over the window, added up on the device and read once; a NaN/inf on
        any rank makes the sum non-finite, so every rank raises together (NAN_CHECK_BOUND says when).
        The same all-reduce carries live mode's vote: whether any rank saw a rank started again ask to
        join (recovery.rejoin), so every rank admits it at the same step."""
        asks = 1.0 if self.live is not None and self.live.join_requested() else 0.0
        both = torch.stack([window_loss.detach().float().reshape(()), torch.full((), asks, device=window_loss.device)])
        total, join = (float(v) for v in all_reduce_sum_(self.ctx, both).tolist())
        if not math.isfinite(total):
            p = self.progress
            raise NonFiniteLoss(
                f"training error: non-finite loss in global steps {window_from + 1}-{p.global_step} (epoch {p.epoch + 1}, "
                f"step {p.step_in_epoch}); likely causes: learning rate too high (optim.lr={self.cfg.optim.lr}), "
                f"fp16 overflow, or bad input values; rerun with debug.detect_anomaly=true to find the op; the "
                f"last good checkpoint is kept in {self.ckpt_root}"
            )
        return total, join > 0

    def _startup_seconds(self) -> float:
        """Process start -> this process's first training step done (one device sync, once)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return process_age_s()

    def _preempted(self, log: RunLog) -> int:
        """The agreed stop's checkpoint. In live mode a peer lost during it (a node's end reaches its
        ranks at different moments: on Slurm the batch host's loss ends the job, and the rank left is
        told to stop while its peer's death is still on the way) makes the ranks left regroup and save
        again, rather than leave without it (exit 1, the steps since the last checkpoint trained again)."""
        start = time.perf_counter()
        progress_beat.flush()  # the step reached, on disk: what the launcher counts as lost if the save never commits
        if self.progress.global_step == 0:  # the first step was dropped: nothing trained, nothing to save
            if self.ctx.is_main:
                log.line("preempted before the first step finished: nothing to save; run the same command again")
            return PREEMPTED
        self._surviving(log, "checkpoint", lambda: self.save(synchronous=True))
        if self.ctx.is_main:
            status.note_committed(self.progress.global_step)  # the launcher's word for it, read without torch
            waited = (time.monotonic() - self.watcher.received_at) if self.watcher.received_at else None
            since = f", {waited:.1f} s after the signal" if waited is not None else ""
            log.line(
                f"preempted: checkpoint committed at global step {self.progress.global_step} in "
                f"{time.perf_counter() - start:.2f} s{since}; run the same command again to resume"
            )
        return PREEMPTED

    def _warn_lead_time(self, log: RunLog) -> None:
        """At start, one line when a checkpoint would not fit in the time a stop leaves: the configured
        lead time, else the platform's grace that the launcher passed on (torchlaunch.grace)."""
        lead, what = self.cfg.preemption.lead_time_s, "preemption.lead_time_s"
        if not lead and contract.get(contract.GRACE):
            lead, what = float(grace.ranks_window_s(grace.platform_grace(os.environ)[0])), "the platform's grace"
        if lead and self.ctx.is_main:
            warning = lead_time_warning(
                lead, self.run_dir / ".save-probe", self.state_dict_for_probe(), what, self.cfg.checkpoint.every_steps
            )
            if warning:
                log.line(warning)

    def state_dict_for_probe(self) -> dict[str, Any]:
        return {
            "format_version": ckpt.FORMAT_VERSION,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def _stage_final_model(self) -> Path:
        """model.pt's bytes, durable under a temporary name; the caller moves them into place."""
        tmp = rundir.temp_name(rundir.model(self.run_dir))
        with rundir.staged(rundir.model(self.run_dir), tmp=tmp) as fh:
            torch.save(self.model.state_dict(), fh)
        return tmp
