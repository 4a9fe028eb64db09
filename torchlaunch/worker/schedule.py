"""When the training loop logs, checkpoints, validates, checks and stops: pure decisions, no torch.

Every rank computes the same decisions from the same numbers (step counts and the config), so the
collectives that follow a decision (the loss sum, a save's RNG gather, validation) line up on every
rank without being negotiated. Keeping them here, apart from the loop that acts on them, lets them
be tested without building a model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """What to do after one optimizer step."""

    log: bool
    """Write a progress line and a metrics record."""
    save: bool
    """Periodic mid-epoch checkpoint (checkpoint.every_steps)."""
    epoch_end: bool
    """The epoch's last training step: validation follows."""
    last: bool
    """The run's last training step (train.max_steps or the last epoch's end)."""

    @property
    def check(self) -> bool:
        """Read the device: the agreed loss sum (finite check) and every pending preemption flag.
        Before any log line, checkpoint or validation, so neither ever follows a non-finite loss."""
        return self.log or self.save or self.epoch_end or self.last


@dataclass(frozen=True)
class EpochPlan:
    """What to do once an epoch's validation has run."""

    finished_epoch: bool
    """The epoch's training steps are all done (not so when max_steps ended the run mid-epoch)."""
    done: bool
    """Training is over: the final checkpoint and model.pt follow."""
    save: bool
    """Periodic end-of-epoch checkpoint (checkpoint.every_epochs); the final one is `done`."""


@dataclass(frozen=True)
class LoopSchedule:
    """The loop's decisions for one run: step counts from the batch plan, periods from the config."""

    steps_per_epoch: int
    epochs: int
    total_steps: int
    log_every: int
    save_every_steps: int = 0
    save_every_epochs: int = 0
    agreement_lag: int = 0
    """Steps between posting a rank's preemption flag and reading the agreed value (check points
    read every pending flag at once). 0 reads each step's flag at that step."""

    def training(self, epoch: int, global_step: int, val_pending: bool = False) -> bool:
        """Training steps or a pending validation remain (a run stopped after its last training step
        still owes the final validation and checkpoint)."""
        return val_pending or (epoch < self.epochs and global_step < self.total_steps)

    def after_step(self, global_step: int, step_in_epoch: int) -> StepPlan:
        """Decisions after the optimizer step that made the counts `global_step` and `step_in_epoch`."""
        epoch_end = step_in_epoch >= self.steps_per_epoch
        return StepPlan(
            log=global_step % self.log_every == 0 or global_step == self.total_steps,
            save=bool(self.save_every_steps) and global_step % self.save_every_steps == 0 and not epoch_end,
            epoch_end=epoch_end,
            last=global_step >= self.total_steps,
        )

    def agreement_through(self, global_step: int, check: bool) -> int:
        """The newest step whose agreed preemption flag is read now: this step at check points,
        `agreement_lag` steps back elsewhere (the same on every rank, so every rank stops together)."""
        return global_step if check else global_step - self.agreement_lag

    def final_validation(self, epoch: int, global_step: int, step_in_epoch: int) -> bool:
        """The validation about to run is the run's last one (test-time augmentation applies)."""
        return global_step >= self.total_steps or (step_in_epoch >= self.steps_per_epoch and epoch + 1 >= self.epochs)

    def after_validation(self, epoch: int, global_step: int, step_in_epoch: int) -> EpochPlan:
        """Decisions once validation of `epoch` has run (`epoch` not yet advanced)."""
        finished = step_in_epoch >= self.steps_per_epoch
        next_epoch = epoch + 1 if finished else epoch
        done = next_epoch >= self.epochs or global_step >= self.total_steps
        periodic = finished and bool(self.save_every_epochs) and next_epoch % self.save_every_epochs == 0
        return EpochPlan(finished_epoch=finished, done=done, save=not done and periodic)
