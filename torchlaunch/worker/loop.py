"""The trainer's loop (Trainer.fit): epochs of steps, each epoch's validation, and the agreed stop.

A part of class Trainer (worker/trainer.py) kept in a module of its own: its methods read what
Trainer.__init__ builds. The loop's decisions (log, save, validate, check, stop) come from
worker/schedule.py.

No step waits for the device except at check points (log points, saves, epoch ends, the last step
and an agreed preemption): the loss stays on the device in a running sum (LossWindow), and each step's
preemption flag is all-reduced without waiting and read a few steps later (core/preemption.py
StepAgreement), the same step on every rank. At a check point the all-reduced loss sum is read: a
non-finite sum on any rank stops every rank together (Trainer.NAN_CHECK_BOUND).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from torchlaunch import status
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.dist import all_reduce_sum_
from torchlaunch.core.preemption import StepAgreement
from torchlaunch.core.step_drop import StepDropped
from torchlaunch.exit_codes import OK, PREEMPTED, BadInput
from torchlaunch.jobs import progress as progress_beat
from torchlaunch.jobs.progress import heartbeat
from torchlaunch.live import minimum
from torchlaunch.startup import process_age_s
from torchlaunch.worker.metrics import RunLog


class Admitted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The shares changed between two steps (a rank started again joined at a check point, or the
    balance moved micro-batches): the epoch's steps go on from the same position with the new shares
    (_train_epoch catches it)."""


class NonFiniteLoss(BadInput):
    """The loss became NaN/inf; a deterministic rerun would hit it again, so it counts as bad input."""


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


class TrainingLoop:
    """Trainer.fit and what it runs between the steps and validations (worker/steps.py, worker/validation.py)."""

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
            except Admitted:  # the group grew, or the balance moved micro-batches: the steps go on with the new shares
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
            if self.new_counts is not None:  # a straggler found (worker/balance.py): the shares move
                self.rebalance(log)
                raise Admitted
        return True

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
