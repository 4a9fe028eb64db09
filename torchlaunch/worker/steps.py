"""The trainer's optimizer step (Trainer.train_step) and what a change of group does to it.

A part of class Trainer (worker/trainer.py) kept in a module of its own: its methods read what
Trainer.__init__ builds. The step averages gradients the group's way (worker/groups/), accumulates over
micro-batches (worker/accumulate.py) or runs train.exact's grid (worker/grid.py), and drops the step
in flight on an agreed stop (core/step_drop.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchlaunch.core.preemption import StepAgreement
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.core.step_drop import StepDrop, StepDropped
from torchlaunch.worker.accumulate import backward_share
from torchlaunch.worker.metrics import WorldSize

if TYPE_CHECKING:
    from torchlaunch.worker.loop import LossWindow
    from torchlaunch.worker.metrics import RunLog


class Steps:
    """One optimizer step over this rank's micro-batches, and the step's state when the group changes."""

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
                completing=lambda: self.group.completing_backward(self.ctx.world_size),
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
        grid.agree(self.ctx.rank, self.ctx.world_size)
        if drop is not None and drop.agreed():
            grid.discard()
            drop.restore()
            self.zero_gradients()
            raise StepDropped
        grid.finish()
        if self.balance is not None:  # every rank reads the same paces: the same counts at the same step
            self.new_counts = self.balance.observe(grid.paces)
        return total * (self.ctx.world_size / self.grid)

    def rebalance(self, log: RunLog) -> None:
        """The counts the balance chose, from the next step on (the loop then restarts the epoch's
        batches from the same position with the new shares, as after an admission)."""
        counts, self.new_counts = self.new_counts, None
        assert counts is not None
        paces = " ".join(f"{1000 * s:.0f}" for s in self.grid_step.paces) if self.grid_step else ""
        self.plan = dataclasses.replace(self.plan, counts=counts)
        self.loader.plan = self.plan
        log.line(
            f"balance: micro-batches per rank {'/'.join(map(str, counts))} from global step "
            f"{self.progress.global_step + 1} (ms per micro-batch: {paces}); the model's bits do not change"
        )

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
        if self.balance is not None:  # a new group starts from the even split
            self.balance.restart(plan.world_size)
        self.new_counts = None
        self.plan = plan
        self.loader.plan = plan
        self.world = WorldSize.of(self.ctx)
        self.agreement = StepAgreement(self.ctx)
        if window is not None:
            window.reset(self.progress.global_step)
