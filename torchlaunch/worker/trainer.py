"""The training loop: AMP, gradient accumulation, clipping, finite checks, validation, checkpoints.

One Trainer per rank. All ranks run the same sequence of collectives: per step one tiny all-reduce
of "a rank was signalled", so a preemption is agreed at the same step everywhere. The loss stays on
the device between check points (log points, saves, preemption, epoch end), where its all-reduced
sum is read: a non-finite sum on any rank stops every rank together (Trainer.NAN_CHECK_BOUND).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchlaunch import config as config_mod
from torchlaunch.config import ConfigError, RunConfig
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.checkpoint import capture_rng, restore_rng
from torchlaunch.core.dist import (
    DistContext,
    all_reduce_sum,
    broadcast_buffers,
    broadcast_object,
    gather_objects,
    ordered_allreduce_hook,
)
from torchlaunch.core.preemption import PreemptionWatcher, agree
from torchlaunch.core.shm_reduce import build_reducer, shared_memory_hook
from torchlaunch.exit_codes import OK, PREEMPTED, BadInput
from torchlaunch.startup import process_age_s
from torchlaunch.tools.debug import check_model_io
from torchlaunch.worker import optim as optim_mod
from torchlaunch.worker.data import BatchPlan, DataBundle, ImageSet, Normalizer, TrainLoader, eval_batches
from torchlaunch.worker.lookahead import Lookahead
from torchlaunch.worker.models import build_model
from torchlaunch.worker.precision import choose_for_run as choose_cpu_precision
from torchlaunch.worker.precision import note as precision_note
from torchlaunch.worker.precision import refuse_fp16_on_cpu
from torchlaunch.worker.tta import tta_logits

VERSION = "0.1.0"


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


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` without a measurement (evaluation): bf16/fp16 on CUDA, bf16 where oneDNN supports it."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if torch.backends.mkldnn.is_available() and _cpu_bf16_ok() else "fp32"


def training_precision(cfg: RunConfig, ctx: DistContext, data: DataBundle) -> str:
    """The run's precision. CPU: fp16 is refused (emulated, ~17x slower); `auto` is measured once per
    machine and model and recorded in RUN_DIR (train/precision.py), rank 0 decides for every rank; the
    choice replaces `auto` in cfg, so every checkpoint's config names it."""
    refuse_fp16_on_cpu(cfg.train.precision, ctx.device.type == "cpu")
    if cfg.train.precision != "auto" or ctx.device.type != "cpu":
        return resolve_precision(cfg.train.precision, ctx.device)
    choice, line = None, ""
    if ctx.is_main:
        micro = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // ctx.world_size)
        choice, line = choose_cpu_precision(
            Path(cfg.run_dir),
            Path(cfg.data.cache_dir).expanduser(),
            cfg.model.name,
            cfg.model.width,
            data.num_classes,
            data.image_size,
            micro,
            cfg.train.channels_last,
        )
        precision_note(line)
    chosen = str(broadcast_object(ctx, choice))
    cfg.train.precision = chosen  # checkpoints then record it: train.evaluate validates the same way
    return chosen


def _cpu_bf16_ok() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (DDP also broadcasts it); per-rank streams for anything else."""
    torch.manual_seed(seed)
    random.seed(seed * 1000 + rank)
    np.random.seed((seed * 1000 + rank) % (2**32))


def lr_lambda_factory(cfg: RunConfig, steps_per_epoch: int, total_steps: int):
    warmup = int(round(cfg.optim.warmup_epochs * steps_per_epoch))
    sched = cfg.optim.schedule

    start = cfg.optim.warmup_start_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return start + (1 - start) * step / warmup if start else (step + 1) / warmup
        if sched == "constant":
            return 1.0
        if sched == "step":
            return cfg.optim.step_gamma ** (step // (cfg.optim.step_epochs * steps_per_epoch))
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        floor = cfg.optim.min_lr_ratio
        if sched == "linear":
            return 1.0 - (1 - floor) * progress
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(cfg: RunConfig, model: nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters; with optim.norm_lr_scale != 1 the BatchNorm ones get their own group
    (LR x scale, weight decay / scale: the same decay per step)."""
    o = cfg.optim
    norm_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for p in m.parameters(recurse=False)
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    if o.norm_lr_scale == 1.0:
        return [{"params": trainable, "lr": o.lr, "weight_decay": o.weight_decay}]
    norms = [p for p in trainable if id(p) in norm_ids]
    others = [p for p in trainable if id(p) not in norm_ids]
    groups = [{"params": others, "lr": o.lr, "weight_decay": o.weight_decay}]
    if norms:
        groups.append({"params": norms, "lr": o.lr * o.norm_lr_scale, "weight_decay": o.weight_decay / o.norm_lr_scale})
    return groups


def build_optimizer(cfg: RunConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The recipe's optimizer (train/optim.py). Without model.compile it never imports torch._dynamo,
    the largest item of start-up otherwise (issue 15)."""
    o = cfg.optim
    return optim_mod.build(
        o.name,
        param_groups(cfg, model),
        device,
        eager_only=not cfg.model.compile,
        lr=o.lr,
        momentum=o.momentum,
        nesterov=o.nesterov and o.momentum > 0,
        weight_decay=o.weight_decay,
        betas=tuple(o.betas),
    )


def whitening_sample(images: ImageSet, normalize: Normalizer, image_size: int, limit: int = 5000) -> torch.Tensor:
    """The first `limit` training images, normalised, unaugmented: what data-dependent initialisations
    (the fastnet stem) are computed from. Same on every rank."""
    if images.images is not None:
        batch = images.images[:limit]
    else:  # per-file path (images of any size): decode a smaller sample at the training size
        batch = torch.stack([images.decode(i, image_size) for i in range(min(limit, 1000, len(images)))])
    return normalize(batch.to(normalize.scale.device)).contiguous()


class MetricsLog:
    """RUN_DIR/metrics.jsonl on rank 0; on resume, lines past the checkpoint are dropped so a
    resumed run's log reads like one uninterrupted run."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None, tensorboard_dir: Path | None = None) -> None:
        self.path, self.enabled = path, enabled
        self.tb = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard_dir is not None:
            self.tb = open_tensorboard(tensorboard_dir, purge_step=resume_step + 1 if resume_step is not None else None)
        if resume_step is not None and path.is_file():
            kept = [
                ln
                for ln in path.read_text().splitlines()
                if _line_step(ln) is not None and _line_step(ln) <= resume_step
            ]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, path)
        elif resume_step is None and path.is_file():
            path.unlink()
        self._fh = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self._fh.write(json.dumps(record) + "\n")
            if self.tb is not None:
                for key, value in record.items():
                    if key not in ("step", "epoch") and isinstance(value, (int, float)):
                        self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._fh.close()
            if self.tb is not None:
                self.tb.close()


def require_tensorboard():
    """The SummaryWriter class, or one clear line when the optional package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "train.tensorboard",
            "the tensorboard package is not installed",
            "pip install -e '.[tensorboard]', or set train.tensorboard=false",
        ) from None
    return SummaryWriter


def open_tensorboard(folder: Path, purge_step: int | None):
    return require_tensorboard()(log_dir=str(folder), purge_step=purge_step)


def _line_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class Reporter:
    """Rank-0 progress: a tqdm bar on a terminal, plain periodic lines in batch logs."""

    def __init__(self, enabled: bool, total_steps: int, start_step: int) -> None:
        self.enabled = enabled
        self.bar = None
        if enabled and (sys.stderr.isatty() or os.environ.get("TORCHLAUNCH_PROGRESS_BAR") == "1"):
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class FaultSignal:
    """Test aid: TORCHLAUNCH_FAULT_SIGNAL="at=step|val|save,n=N[,rank=R][,sig=SIGTERM]" makes rank R send
    itself a real signal at an exact point (after global step N, during validation of epoch N, right
    after the checkpoint of step N), so resume tests can hit every interruption point reproducibly."""

    def __init__(self, spec: str | None, rank: int) -> None:
        fields = dict(kv.split("=", 1) for kv in spec.split(",")) if spec else {}
        self.at = fields.get("at")
        self.n = int(fields.get("n", "-1"))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # once per launch
        self.active = bool(spec) and int(fields.get("rank", "0")) == rank and first_attempt
        self.signum = getattr(__import__("signal"), fields.get("sig", "SIGTERM"))
        self.fired = False

    def __call__(self, at: str, n: int) -> None:
        if self.active and not self.fired and at == self.at and n == self.n:
            self.fired = True
            os.kill(os.getpid(), self.signum)


class Trainer:
    """Builds model, optimizer, schedule and loaders for one rank, and runs fit()."""

    def __init__(self, cfg: RunConfig, ctx: DistContext, data: DataBundle, watcher: PreemptionWatcher) -> None:
        self.cfg, self.ctx, self.data, self.watcher = cfg, ctx, data, watcher
        self.device = ctx.device
        if cfg.train.tensorboard:
            require_tensorboard()  # fail on every rank together, before any collective
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.precision = training_precision(cfg, ctx, data)
        if self.precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.precision", "this GPU has no bf16 support", "use fp16 or fp32")
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
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
        )
        total = self.plan.steps_per_epoch * cfg.train.epochs
        self.total_steps = min(total, cfg.train.max_steps) if cfg.train.max_steps else total

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
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_factory(cfg, self.plan.steps_per_epoch, self.total_steps)
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.net: nn.Module = model
        self.gradient_path = "local"
        if ctx.distributed:
            self.net = DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
            self.gradient_path = self._choose_gradient_path(self.net, model)
        if cfg.model.compile:
            self.net = torch.compile(self.net)
        self.lookahead = (
            Lookahead(model, cfg.optim.lookahead_every, cfg.optim.lookahead_decay, self.total_steps)
            if cfg.optim.lookahead_every
            else None
        )
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
        self.loader = TrainLoader(
            data.train, self.plan, normalize, self.device, cfg.data.augment, cfg.data.num_workers, data.image_size
        )
        self.progress = Progress()
        self.fault = FaultSignal(os.environ.get("TORCHLAUNCH_FAULT_SIGNAL"), ctx.rank)
        self.writer = ckpt.AsyncWriter()
        self.snapshots = ckpt.SnapshotBuffers()  # reused between async saves (no fresh pages per save)
        self.last_saved: tuple[int, int, bool] | None = None
        self.save_seconds: float | None = None

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

    def _check_model(self, model: nn.Module) -> None:
        """One fake batch through the model: shape and device mistakes become one clear line."""
        shape = (3, self.data.image_size, self.data.image_size)
        check_model_io(model, shape, self.data.num_classes, self.device, memory_format=self.memory_format)

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit for bit (RNG of every rank included)."""
        rng = gather_objects(self.ctx, capture_rng(self.device))
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
            "world_size": self.ctx.world_size,
            "global_batch": self.plan.global_batch,
            "rng": rng,
            "classes": list(self.data.classes),
            "plugins": self.plugins,
            "norm": {"mean": list(self.data.mean), "std": list(self.data.std)},
            "config": config_mod.to_dict(self.cfg),
            "versions": {"torchlaunch": VERSION, "torch": str(torch.__version__), "python": platform.python_version()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise BadInput(
                f"checkpoint error: the checkpoint's model does not match model.name="
                f"{self.cfg.model.name}: {str(e).splitlines()[0]} (resume with the config it was "
                f"saved with, or start a new run_dir)"
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
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
        self.progress = Progress(
            pr["epoch"],
            pr["step_in_epoch"],
            pr["global_step"],
            pr["val_pending"],
            pr["best_val_acc"],
            dict(pr["last_val"]),
        )
        rng = state["rng"]
        if state["world_size"] == self.ctx.world_size:
            restore_rng(rng[self.ctx.rank], self.device)
        else:  # a new world size has new ranks: derive fresh per-rank streams deterministically
            seed_everything(self.cfg.seed + pr["global_step"], self.ctx.rank)
        self.last_saved = (pr["global_step"], pr["epoch"], pr["val_pending"])

    def resume(self) -> Path | None:
        """Load the checkpoint rank 0 picked (every rank reads the same folder from shared storage)."""
        chosen = None
        if self.ctx.is_main:
            ckpt.clean_stale(self.ckpt_root)
            found = ckpt.resolve_resume(self.cfg.checkpoint.resume, self.ckpt_root, "cpu")
            chosen = str(found[0]) if found else None
        chosen = broadcast_object(self.ctx, chosen)
        if chosen is None:
            return None
        path = Path(chosen)
        state = ckpt.load_state(path, "cpu")
        self.load_state_dict(state)
        return path

    def save(self, synchronous: bool, validated: bool = False, final: bool = False) -> None:
        """Every rank joins (RNG gather); rank 0 writes. Periodic saves go to the background.

        A checkpoint of the same step is rewritten only when validation has run since (the state
        saved by a preemption during validation is superseded by the validated one). `final`: training
        is over, so the live tensors are committed in the background without a snapshot copy while the
        caller writes model.pt, and the caller waits for the commit."""
        p = self.progress
        position = (p.global_step, p.epoch, p.val_pending)
        if self.last_saved == position:
            return
        replace = self.last_saved is not None and self.last_saved[0] == p.global_step
        state = self.state_dict()
        self.last_saved = position
        if not self.ctx.is_main:
            return
        meta = {
            "epoch": p.epoch,
            "step_in_epoch": p.step_in_epoch,
            "world_size": self.ctx.world_size,
            "val_pending": p.val_pending,
        }
        if validated:
            meta.update(p.last_val)
        step = p.global_step
        keep = self.cfg.checkpoint.keep

        def commit(snapshot: dict[str, Any]) -> ckpt.CommitInfo:
            return ckpt.commit_with_retention(self.ckpt_root, step, snapshot, meta, keep, replace=replace)

        if final and self.cfg.checkpoint.async_save:
            self.writer.submit(lambda: commit(state))  # nothing mutates the tensors any more
        elif synchronous or not self.cfg.checkpoint.async_save:
            self.writer.wait()
            info = commit(state)
            self.save_seconds = info.seconds
        else:
            snapshot = self.snapshots.take(state)  # training mutates the live tensors in place
            try:
                self.writer.submit(lambda: snapshot.write_with(commit))
            except BaseException:  # the previous write failed: this snapshot is never written
                snapshot.release()
                raise

    # ------------------------------------------------------------------ steps

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the rank's mean loss as a 0-d
        float32 tensor on the device: reading it (float()) waits for the step, so the loop only reads
        its running sum at log points (no host synchronisation per step)."""
        self.net.train()
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            sync = i == n - 1
            ctx = (
                self.net.no_sync()
                if (not sync and isinstance(self.net, DistributedDataParallel))
                else contextlib.nullcontext()
            )
            with ctx:
                with self.autocast():
                    loss = self.criterion(self.net(x), y) / n
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        if self.cfg.train.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(total)

    def evaluate(self, tta: str = "none") -> dict[str, float] | None:
        """Loss and top-1 over the validation set, each sample counted once; None if preempted."""
        self.net.eval()
        broadcast_buffers(self.ctx, self.model)  # evaluate exactly the model a checkpoint holds
        sums = [0.0, 0.0, 0.0]
        batch = max(self.plan.micro, 256)
        with torch.no_grad():
            batches = eval_batches(
                self.data.val,
                self.ctx.rank,
                self.ctx.world_size,
                batch,
                self.normalize,
                self.device,
                self.data.image_size,
                0,
            )
            n_batches = math.ceil(max(1, len(self.data.val) // self.ctx.world_size + 1) / batch)
            for i in range(n_batches + 1):  # same number of agreement rounds on every rank
                if agree(self.ctx, self.watcher.requested)[0]:
                    return None
                item = next(batches, None)
                if i == 0:
                    self.fault("val", self.progress.epoch)
                if item is None:
                    continue
                x, y = item
                with self.autocast():
                    logits = tta_logits(self.model, x, tta)  # not the DDP wrapper: its forward is a
                    # collective, and ranks may hold different numbers of validation batches
                sums[0] += float(nn.functional.cross_entropy(logits.float(), y, reduction="sum"))
                sums[1] += float((logits.argmax(1) == y).sum())
                sums[2] += y.numel()
        loss_sum, correct, count = all_reduce_sum(self.ctx, sums)
        return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_samples": count}

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        resumed = self.resume()
        p = self.progress
        main = self.ctx.is_main
        metrics = MetricsLog(
            self.run_dir / "metrics.jsonl",
            main,
            p.global_step if resumed else None,
            self.run_dir / "tb" if self.cfg.train.tensorboard else None,
        )
        trace = MetricsLog(
            self.run_dir / "trace" / f"rank{self.ctx.rank}.jsonl",
            self.cfg.debug.trace_batches,
            p.global_step if resumed else None,
        )
        report = Reporter(main, self.total_steps, p.global_step)
        if resumed:
            report.line(
                f"resumed from {resumed} at epoch {p.epoch} step {p.step_in_epoch} (global step {p.global_step})"
            )
        else:
            report.line(
                f"starting {self.cfg.model.name} on {self.ctx.world_size} x {self.device.type} "
                f"({self.precision}), {self.plan.steps_per_epoch} steps/epoch x {self.cfg.train.epochs} "
                f"epochs, global batch {self.plan.global_batch} (accumulation {self.plan.accumulation}), "
                f"gradients: {self.gradient_path}"
            )
        if main:
            ckpt.clean_stale(self.ckpt_root)
        self._warn_lead_time(report)
        window_start, window_steps, window_loss = time.perf_counter(), 0, self._zero_window()
        window_from = p.global_step  # the window holds the losses of the steps after this one
        run_start = time.perf_counter()
        startup_note: str | None = None  # start-up figure, for the first progress line of this process
        first_step = True
        try:
            while p.epoch < self.cfg.train.epochs and p.global_step < self.total_steps:
                if not p.val_pending:
                    perm = self.plan.permutation(p.epoch) if self.cfg.debug.trace_batches else None
                    for step, micro in self.loader.epoch(p.epoch, p.step_in_epoch):
                        if perm is not None:
                            trace.write(
                                {
                                    "step": p.global_step + 1,
                                    "epoch": p.epoch,
                                    "world_size": self.ctx.world_size,
                                    "indices": self.plan.rank_step(perm, p.epoch, step)[0].tolist(),
                                }
                            )
                        step_start = time.perf_counter() if first_step else 0.0
                        loss = self.train_step(micro)
                        p.step_in_epoch = step + 1
                        p.global_step += 1
                        if self.lookahead is not None:
                            self.lookahead.after_step(p.global_step)
                        window_steps += 1
                        window_loss += loss  # on the device: read only at check points below
                        if first_step:
                            first_step = False
                            startup = self._startup_seconds()
                            metrics.write(
                                {
                                    "step": p.global_step,
                                    "epoch": p.epoch,
                                    "startup_s": startup,
                                    "first_step_s": time.perf_counter() - step_start,
                                }
                            )
                            startup_note = f", start-up {startup:.2f} s (process start to first step)"
                        report.step()
                        self.fault("step", p.global_step)
                        (preempt,) = agree(self.ctx, self.watcher.requested)
                        log_now = (
                            p.global_step % self.cfg.train.log_every_steps == 0 or p.global_step == self.total_steps
                        )
                        every = self.cfg.checkpoint.every_steps
                        save_now = (
                            bool(every) and p.global_step % every == 0 and p.step_in_epoch < self.plan.steps_per_epoch
                        )
                        if log_now or preempt or save_now or p.step_in_epoch >= self.plan.steps_per_epoch:
                            # The finite check: before any log line, checkpoint or validation (NAN_CHECK_BOUND)
                            loss_sum = self._agreed_loss_sum(window_loss, window_from)
                        if log_now:
                            mean_loss = loss_sum / (window_steps * self.ctx.world_size)
                            elapsed = time.perf_counter() - window_start
                            rate = window_steps * self.plan.global_batch / max(elapsed, 1e-9)
                            lr = self.scheduler.get_last_lr()[0]
                            metrics.write(
                                {
                                    "step": p.global_step,
                                    "epoch": p.epoch,
                                    "loss": mean_loss,
                                    "lr": lr,
                                    "images_per_s": rate,
                                    "elapsed_s": time.perf_counter() - run_start,
                                }
                            )
                            report.line(
                                f"epoch {p.epoch + 1}/{self.cfg.train.epochs} step {p.step_in_epoch}/"
                                f"{self.plan.steps_per_epoch} loss {mean_loss:.4f} lr {lr:.4g} "
                                f"{rate:,.0f} img/s{startup_note or ''}"
                            )
                            startup_note = None
                            window_start, window_steps, window_loss = time.perf_counter(), 0, self._zero_window()
                            window_from = p.global_step
                        if preempt:
                            return self._preempted(report)
                        if save_now:
                            self.save(synchronous=False)
                            self.fault("save", p.global_step)
                        if p.global_step >= self.total_steps:
                            break
                    p.val_pending = True
                last = p.global_step >= self.total_steps or (
                    p.step_in_epoch >= self.plan.steps_per_epoch and p.epoch + 1 >= self.cfg.train.epochs
                )
                tta = self.cfg.train.tta if last else "none"
                val = self.evaluate(tta)
                if val is None:
                    return self._preempted(report)
                if tta != "none":
                    val["tta"] = tta
                p.last_val = {k: v for k, v in val.items() if k not in ("val_samples", "tta")}
                if p.best_val_acc is None or val["val_acc"] > p.best_val_acc:
                    p.best_val_acc = val["val_acc"]
                metrics.write(
                    {"step": p.global_step, "epoch": p.epoch, **val, "elapsed_s": time.perf_counter() - run_start}
                )
                report.line(
                    f"epoch {p.epoch + 1}/{self.cfg.train.epochs} validation: loss {val['val_loss']:.4f} "
                    f"top-1 {val['val_acc']:.4f} ({int(val['val_samples'])} images"
                    f"{', test-time augmentation ' + tta if tta != 'none' else ''})"
                )
                p.val_pending = False
                finished_epoch = p.step_in_epoch >= self.plan.steps_per_epoch
                if finished_epoch:
                    p.epoch += 1
                    p.step_in_epoch = 0
                done = p.epoch >= self.cfg.train.epochs or p.global_step >= self.total_steps
                every_epochs = self.cfg.checkpoint.every_epochs
                if done:
                    self.save(synchronous=True, validated=True, final=True)
                elif finished_epoch and every_epochs and p.epoch % every_epochs == 0:
                    self.save(synchronous=False, validated=True)
                    self.fault("save", p.global_step)
            staged = self._stage_final_model() if main else None  # written while the checkpoint commits
            try:
                self.writer.wait()
            except BaseException:
                if staged is not None:
                    staged.unlink(missing_ok=True)
                raise
            if staged is not None:  # model.pt appears only once the final checkpoint is committed
                os.replace(staged, self.run_dir / "model.pt")
                report.line(
                    f"finished: {p.global_step} steps, final validation top-1 "
                    f"{p.last_val.get('val_acc', float('nan')):.4f}; model saved to {self.run_dir / 'model.pt'}"
                )
            return OK
        finally:
            try:
                self.writer.wait()
            finally:
                metrics.close()
                trace.close()
                report.close()

    NAN_CHECK_BOUND = (
        "a non-finite training loss stops the run (exit 2) at the first check point after it: "
        "the next log point (every train.log_every_steps steps), checkpoint, preemption or end of "
        "the epoch, whichever comes first; never after a checkpoint or validation of that state"
    )
    """The finite check reads the running loss sum, which waits for the device: only at check points."""

    def _zero_window(self) -> torch.Tensor:
        """The running loss sum of the steps since the last log point, kept on the device (float64:
        the same sums, bit for bit, as adding the losses up as Python floats)."""
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def _agreed_loss_sum(self, window_loss: torch.Tensor, window_from: int) -> float:
        """Every rank's loss sum over the window, added up; a NaN/inf on any rank makes the sum
        non-finite, so every rank raises together (NAN_CHECK_BOUND says when this runs)."""
        total = all_reduce_sum(self.ctx, [float(window_loss)])[0]
        if not math.isfinite(total):
            p = self.progress
            raise NonFiniteLoss(
                f"training error: non-finite loss in global steps {window_from + 1}-{p.global_step} (epoch {p.epoch}, "
                f"step {p.step_in_epoch}); likely causes: learning rate too high (optim.lr={self.cfg.optim.lr}), "
                f"fp16 overflow, or bad input values; rerun with debug.detect_anomaly=true to find the op; the "
                f"last good checkpoint is kept in {self.ckpt_root}"
            )
        return total

    def _startup_seconds(self) -> float:
        """Process start -> this process's first training step done (one device sync, once)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return process_age_s()

    def _preempted(self, report: Reporter) -> int:
        start = time.perf_counter()
        self.save(synchronous=True)
        if self.ctx.is_main:
            waited = (time.monotonic() - self.watcher.received_at) if self.watcher.received_at else None
            since = f", {waited:.1f} s after the signal" if waited is not None else ""
            report.line(
                f"preempted: checkpoint committed at global step {self.progress.global_step} in "
                f"{time.perf_counter() - start:.2f} s{since}; run the same command again to resume"
            )
        return PREEMPTED

    def _warn_lead_time(self, report: Reporter) -> None:
        lead = self.cfg.preemption.lead_time_s
        if not lead or not self.ctx.is_main:
            return
        probe = self.run_dir / ".save-probe"
        start = time.perf_counter()
        ckpt.write_checkpoint(probe, 0, self.state_dict_for_probe(), {})
        seconds = time.perf_counter() - start
        shutil.rmtree(probe, ignore_errors=True)
        if lead < 3 * seconds:
            report.line(
                f"warning: preemption.lead_time_s={lead:g} is below 3x the measured save time "
                f"({seconds:.2f} s): a preemption may kill the job before its checkpoint commits "
                f"(raise the scheduler's signal lead time / grace period)"
            )

    def state_dict_for_probe(self) -> dict[str, Any]:
        return {
            "format_version": ckpt.FORMAT_VERSION,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def _stage_final_model(self) -> Path:
        """model.pt's bytes, durable under a temporary name; the caller moves them into place."""
        tmp = self.run_dir / ".model.pt.tmp"
        try:
            with open(tmp, "wb") as fh:
                torch.save(self.model.state_dict(), fh)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp
