"""One rank's training: the model, optimizer and loaders it builds, and the state a checkpoint holds.

The class's other parts are modules of their own, each read against what Trainer.__init__ builds: the
optimizer step (worker/steps.py), the loop and its agreed stop (worker/loop.py), and each epoch's
validation (worker/validation.py). The loop's decisions (log, save, validate, check, stop) come from
worker/schedule.py; the optimizer and LR schedule from worker/optim.py, the precision from
worker/precision.py, the run's outputs go through worker/metrics.py and its checkpoints through
core/checkpoint.py.

No step waits for the device except at check points (worker/loop.py says which, and why).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torchlaunch import config as config_mod
from torchlaunch import contract, grace, rundir
from torchlaunch.config import RunConfig
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.dist import DistContext
from torchlaunch.core.preemption import PreemptionWatcher, StepAgreement
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.core.step_drop import StepDrop, applies
from torchlaunch.exit_codes import BadInput, ConfigError
from torchlaunch.worker.balance import Balance
from torchlaunch.worker.data import DataBundle, ImageSet, Normalizer, TrainLoader
from torchlaunch.worker.data.augment import val_resize_for
from torchlaunch.worker.debug import check_model_io
from torchlaunch.worker.faults import FaultSignal
from torchlaunch.worker.grid import GridStep, grid_size, pin_threads
from torchlaunch.worker.groups import FixedGroup, TrainingGroup
from torchlaunch.worker.lead_time import lead_time_warning
from torchlaunch.worker.lookahead import Lookahead
from torchlaunch.worker.loop import TrainingLoop
from torchlaunch.worker.metrics import RunLog, WorldSize, require_tensorboard
from torchlaunch.worker.models import build_model
from torchlaunch.worker.optim import build_optimizer, build_scheduler
from torchlaunch.worker.precision import (
    autocast_dtype,
    training_precision,
)
from torchlaunch.worker.schedule import LoopSchedule
from torchlaunch.worker.state_check import worker_state_problem
from torchlaunch.worker.steps import Steps
from torchlaunch.worker.validation import Validation

VERSION = "0.1.0"

AGREEMENT_LAG = 2
"""Steps between posting a preemption flag and reading the agreed value between check points: the
host never waits for the step it just queued, and a stop comes at most this many steps late."""


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


class Trainer(TrainingLoop, Validation, Steps):
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
        self.balance = Balance(self.grid, ctx.world_size) if self.grid and cfg.train.balance else None
        self.new_counts: tuple[int, ...] | None = None
        """Set by a grid step when the balance moves micro-batches; the loop applies it after the step."""
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
