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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torchlaunch import config as config_mod
from torchlaunch import contract, grace, rundir, status
from torchlaunch.config import RunConfig
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.dist import DistContext, all_reduce_sum_, broadcast_buffers
from torchlaunch.core.preemption import PreemptionWatcher, StepAgreement, agree
from torchlaunch.core.recovery import minimum
from torchlaunch.core.sampler import BatchPlan
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
from torchlaunch.worker.grid import GridStep, grid_size, pin_threads
from torchlaunch.worker.groups import FixedGroup, TrainingGroup
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

VERSION = "0.1.0"

AGREEMENT_LAG = 2
"""Steps between posting a preemption flag and reading the agreed value between check points: the
host never waits for the step it just queued, and a stop comes at most this many steps late."""


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


class Trainer:
    """Builds model, optimizer, schedule and loaders for one rank, and runs fit()."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: DistContext,
        data: DataBundle,
        watcher: PreemptionWatcher,
        group: TrainingGroup | None = None,
    ) -> None:
        """`group`: the training group this rank trains in (worker/groups/), the launcher's fixed group
        unless given; every collective decision that depends on the group's kind is the group's."""
        self.cfg, self.ctx, self.data, self.watcher = cfg, ctx, data, watcher
        self.group: TrainingGroup = group if group is not None else FixedGroup()
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
        self.net, self.gradient_path = self.group.form(self)
        if cfg.model.compile:
            self.net = torch.compile(self.net)
        self.grid_step = (
            GridStep(
                self.net,
                self.grid,
                cfg.seed,
                ctx.distributed,
                keep_grads=self.group.keeps_grad_views,
                shared=self.group.grid_sum,
            )
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
        self.fault = FaultSignal(None, 0) if self.group.joining else FaultSignal.from_env(ctx.rank)
        self.writer = ckpt.AsyncWriter()
        self.snapshots = ckpt.SnapshotBuffers()  # reused between async saves (no fresh pages per save)
        self.last_saved: tuple[int, int, bool] | None = None
        self.save_point: int | None = None
        """The step of the last save asked for: after a regroup, the group checks it was committed."""
        self.save_seconds: float | None = None
        self.agreement: StepAgreement | None = None
        self.step_drop = self._step_drop()

    # ------------------------------------------------------------------ start-up checks

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
        guard = self.group.fence_commit()  # a rank outside a re-formed group never commits
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
            format_name=self.cfg.checkpoint.format,
        )
        background = self.cfg.checkpoint.async_save and not synchronous
        info = checkpointer.save(
            p.global_step,
            self.state_dict() if checkpointer.wants_payload else {},  # the ranks whose share is written
            meta,
            synchronous=not (background or (final and self.cfg.checkpoint.async_save)),
            final=final,
            replace=replace,
            commit_guard=guard,
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
                sync_last=self.ctx.distributed and self.group.reduces_in_backward,  # DDP's are in the last one
            )
            self.group.reduce_gradients(self.ctx.world_size)  # a lost peer fails it before the optimizer step
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
        grid.distributed = self.ctx.distributed  # a group re-formed in place may be of any size
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
        """After a step, the group's way (.grad = None, or a flat buffer zeroed whose views stay)."""
        self.group.zero_gradients(self.optimizer)

    def abandon_step(self) -> None:
        """A peer was lost mid-step or mid-save: the step's partial gradients and posted stop flags go,
        and the last save is not known to be committed (the next save of that step writes it)."""
        self.last_saved = None
        self.zero_gradients()
        assert self.agreement is not None
        self.agreement.forget()

    def group_changed(self, plan: BatchPlan, window: LossWindow | None) -> None:
        """A new group formed (a loss, or a rank admitted): its stop-dropping store, the plan's shares on
        it, the loader's plan and the agreement on it. The loss window restarts (its sum held the old
        group's shares)."""
        self.step_drop = self._step_drop()  # the new group's store: a lost peer's word stays in the old one
        self.plan = plan
        self.loader.plan = plan
        self.world = WorldSize.of(self.ctx)
        self.agreement = StepAgreement(self.ctx)
        if window is not None:
            window.reset(self.progress.global_step)

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
        resumed = self.group.start(self)  # a checkpoint's path, or None (fresh, or a peer's state)
        p = self.progress
        log = RunLog(
            self.run_dir,
            self.ctx.rank,
            epochs=self.cfg.train.epochs,
            steps_per_epoch=self.plan.steps_per_epoch,
            total_steps=self.total_steps,
            global_batch=self.plan.global_batch,
            start_step=p.global_step,
            resume_step=p.global_step if resumed or self.group.joined else None,  # a joiner appends
            tensorboard=self.cfg.train.tensorboard,
            trace=self.cfg.debug.trace_batches,
            started_as=self.group.started_as,  # names this rank's files
            world_size=self.ctx.world_size if resumed else None,  # a joiner leaves the others' files alone
        )
        try:
            self.group.opened(log)
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
            self.group.finish(self, log)
            return OK
        except minimum.BelowMinimum as below:  # raised only by a group that shrinks
            return self.group.below_minimum(self, log, below)
        finally:
            try:
                self.writer.wait()
            finally:
                log.close()

    def _train_epoch(self, log: RunLog, window: LossWindow, first_step: bool) -> bool:
        """The epoch's remaining training steps; False when the ranks agreed to stop (preemption). A
        peer's loss that the group goes on after (group.lost) makes it regroup; the steps go on from the
        one that was interrupted (its optimizer step was never taken)."""
        while True:
            try:
                return self._train_steps(log, window, first_step)
            except Admitted:  # the group grew at a check point: the steps go on with the new shares
                first_step = False
                continue
            except Exception as e:
                why = self.group.lost(e)
                if why is None:
                    raise
            self.group.recover_step(self, log, why, window)  # outside the handler: worker/groups/live.loss_line
            first_step = False

    def _train_steps(self, log: RunLog, window: LossWindow, first_step: bool) -> bool:
        p = self.progress
        agreement = self.agreement
        assert agreement is not None
        perm = self.plan.permutation(p.epoch) if log.tracing else None
        for step, micro in self.loader.epoch(p.epoch, p.step_in_epoch):
            if perm is not None:  # debug.trace_batches: host-side indices, no device read
                indices = self.plan.rank_step(perm, p.epoch, step)[0].tolist()
                generation = self.group.generation
                log.trace(p.global_step + 1, p.epoch, self.ctx.world_size, indices, self.loader.step_trace, generation)
            started = time.perf_counter() if first_step else 0.0
            try:
                window.add(self.train_step(micro))
            except StepDropped:
                log.line(f"stop: dropped step {p.global_step + 1} in flight; committing step {p.global_step}")
                return False
            p.step_in_epoch, p.global_step = step + 1, p.global_step + 1
            self.group.stepped(log, p.global_step)
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
                self.group.admit(self, log, window)
                raise Admitted
        return True

    def _validate(self, log: RunLog) -> bool:
        """The pending validation of this epoch, then the epoch's end (periodic or final checkpoint);
        False when the ranks agreed to stop during it."""
        p = self.progress
        tta = self.cfg.train.tta if self.schedule.final_validation(p.epoch, p.global_step, p.step_in_epoch) else "none"
        val = self.group.surviving(self, log, "validation", lambda: self.evaluate(tta))
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
            self.group.surviving(
                self, log, "checkpoint", lambda: self.save(synchronous=True, validated=True, final=True)
            )
        elif end.save:
            self.group.surviving(self, log, "checkpoint", lambda: self.save(synchronous=False, validated=True))
            self.fault("save", p.global_step)
        return True

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
        The same all-reduce carries the group's vote: whether any rank saw a rank started again ask to
        join (recovery.rejoin), so every rank admits it at the same step."""
        asks = 1.0 if self.group.asks_to_join() else 0.0
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
        """The agreed stop's checkpoint. In a group that survives losses (live), a peer lost during it (a node's end reaches its
        ranks at different moments: on Slurm the batch host's loss ends the job, and the rank left is
        told to stop while its peer's death is still on the way) makes the ranks left regroup and save
        again, rather than leave without it (exit 1, the steps since the last checkpoint trained again)."""
        start = time.perf_counter()
        progress_beat.flush()  # the step reached, on disk: what the launcher counts as lost if the save never commits
        if self.progress.global_step == 0:  # the first step was dropped: nothing trained, nothing to save
            if self.ctx.is_main:
                log.line("preempted before the first step finished: nothing to save; run the same command again")
            return PREEMPTED
        self.group.surviving(self, log, "checkpoint", lambda: self.save(synchronous=True))
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
