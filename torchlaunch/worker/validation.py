"""The trainer's validation (Trainer.evaluate) and what follows it at an epoch's end (a checkpoint).

A part of class Trainer (worker/trainer.py) kept in a module of its own: its methods read what
Trainer.__init__ builds. Each sample is counted once over the ranks (worker/eval_loop.py), and the ranks
agree once per batch whether to stop, so a preemption during validation stops every rank together.
"""

from __future__ import annotations

import math

from torchlaunch.core.dist import broadcast_buffers
from torchlaunch.core.preemption import agree
from torchlaunch.worker import eval_loop
from torchlaunch.worker.data import eval_batches
from torchlaunch.worker.metrics import RunLog


class Validation:
    """The validation of each epoch, then its end: the next epoch, and a periodic or the final checkpoint."""

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
