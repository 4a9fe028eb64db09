"""A stop that arrives mid-step drops the step in flight, on every rank alike, instead of waiting for it.

Why: the world's graces are short (docker stop 10 s, a pod 30 s, a spot VM 30 s) and a step is not
(gradient accumulation, a big model, a busy CPU: 20 s and more). Waiting for the step and then for the
agreement a few steps later (core/preemption.StepAgreement) let the platform's SIGKILL land before the
checkpoint, and every step since the last periodic one was lost. The weights, optimizer, scheduler,
scaler, RNG and data position of the last finished step are still in memory while a step runs: only
its gradients are new. So a stop seen before the next micro-batch abandons the step and that state is
committed at once; the resumed run trains the dropped step again with the same samples, crops and
flips (they come from the batch plan, by step), so the run ends bit for bit where the uninterrupted
one ends.

The agreement cannot be a collective: a rank that stopped computing would leave its peers waiting in
the step's gradient all-reduce. Instead (a store check per micro-batch, no device wait):

1. A rank whose stop flag is set before its next micro-batch, or that finds a peer's word in the store
   then, writes `drop/<step>` into the group's c10d store (a blocking set: the store has it before this
   rank goes on) and skips its remaining micro-batches. Under DDP it still runs the last one (on two
   samples): its forward and backward hold the step's collectives (buffer broadcast, gradient
   all-reduce), which no peer is left waiting in.
   In live mode the gradients are averaged after the micro-batches (live), so it skips them
   all and goes straight to that average.
2. After the step's gradient all-reduce (DDP's synchronised backward, or live mode's average), every
   rank asks the store for `drop/<step>`. The all-reduce completed, so every rank entered it, after any
   write of step 1: all ranks see the same answer. A rank that saw its flag only after it entered the
   all-reduce finishes the step like its peers and drops the next one at its first micro-batch.
3. A dropped step puts back the buffers (BatchNorm statistics) and RNG states taken at its start, and
   its gradients are zeroed; the optimizer, scheduler, scaler and position never moved.

In live mode each group has a store of its own (a regroup makes a new one, and the trainer a new
StepDrop with it): the word of a peer that was lost before the group re-formed never drops a step of the
group that goes on without it.

Where this does not apply, a stop waits for the step boundary as before: NCCL (the host passes the
all-reduce before the device has run it, so step 2's answer is not known to be the same on every rank),
and a single micro-batch longer than the grace (nothing can be dropped before it ends: set
`train.micro_batch_size` so that one micro-batch fits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchlaunch import contract
from torchlaunch.core.dist import DistContext


class StepDropped(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Every rank agreed to drop the step in flight (Trainer._train_steps stops and commits)."""


def applies(ctx: DistContext) -> bool:
    """Whether a stop can drop the step in flight here (see the module's docstring for why not)."""
    return ctx.backend in (None, "gloo")


class StepDrop:
    """One rank's side of the agreement to drop the step in flight (the module's docstring).

    `requested` reads the rank's stop flag (PreemptionWatcher.requested); `store` is the group's c10d
    store (None without a process group). Call begin() before each step, pass leave() to backward_share
    and ask agreed() after the step's gradient all-reduce; restore() when it says so."""

    def __init__(
        self,
        ctx: DistContext,
        model: nn.Module,
        requested: Callable[[], bool],
        store: Any | None,
        prefix: str | None = None,
    ) -> None:
        self.ctx, self.model, self.requested, self.store = ctx, model, requested, store
        restart = contract.get(contract.RESTART_COUNT, "0")
        self.prefix = prefix if prefix is not None else f"torchlaunch/drop/{restart}/"
        self.step = 0
        self.leaving = False
        self._live = [b.detach() for b in model.buffers()]
        """The model's buffers, listed once (listing them costs ~0.5 ms a step for a ResNet-18 on a busy
        CPU): they are updated in place, by training and by load_state_dict alike."""
        self._buffers = [b.clone() for b in self._live]
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def begin(self, step: int) -> None:
        """Before step `step` (1-based global step): what a dropped step must put back. One foreach copy
        of the buffers and the torch (and CUDA) generator states: the step draws from no other (the crops
        and flips come from the batch plan), and numpy's and Python's states cost ~0.2 ms a step to copy."""
        self.step, self.leaving = step, False
        if self._live:
            torch._foreach_copy_(self._buffers, self._live)
        device = self.ctx.device
        self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def leave(self) -> bool:
        """Before each micro-batch: True once this rank's stop flag is set (it then says so in the store,
        once per step, before it enters the step's collectives), or once a peer has said so: a stop that
        reached one rank (one pod deleted, one node preempted) then waits for none of the others'
        micro-batches left, a whole step at worst. One store check, ~35-60 us on loopback."""
        if not self.leaving and (self.requested() or self._peer_left()):
            self.leaving = True
            self._ask(lambda store: store.set(self._key(), b"1"))
        return self.leaving

    def _peer_left(self) -> bool:
        return bool(self._ask(lambda store: store.check([self._key()])))

    def _ask(self, call: Callable[[Any], Any]) -> Any:
        """`call(store)`, or None once the store failed: it is then dropped for good. Its host was lost (in
        live mode the group's store is its rank 0's own, which a node's loss takes along); the step's
        collective fails too, and that failure, not this check, decides what happens (live: a regroup,
        which builds a new StepDrop on the new group's store; static: the job's failure)."""
        if self.store is None:
            return None
        try:
            return call(self.store)
        except RuntimeError:  # torch.distributed.DistNetworkError / DistStoreError
            self.store = None
            return None

    def agreed(self) -> bool:
        """After the step's gradient all-reduce: whether every rank drops this step (the same answer on each)."""
        if self.leaving:
            return True
        return bool(self._ask(lambda store: store.check([self._key()])))

    def restore(self) -> None:
        """Put back the buffers and RNG states of the step's start (the step's BatchNorm statistics and
        random draws are the dropped step's, which the resumed run draws again)."""
        with torch.no_grad():
            if self._live:
                torch._foreach_copy_(self._live, self._buffers)
        if self._rng is not None:
            cpu, cuda = self._rng
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.ctx.device)

    def _key(self) -> str:
        return f"{self.prefix}{self.step}"
