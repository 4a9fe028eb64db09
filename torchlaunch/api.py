"""The public API for user training scripts: the project's guarantees for a plain PyTorch loop.

A thin facade over the pieces the built-in worker uses (core.dist, core.checkpoint's Checkpointer,
core.preemption and core.sampler's batch plan); it adds no second implementation of the commit,
checksum, retention, snapshot buffers, RNG capture or cross-rank agreement:

    with api.setup() as ctx:                         # process group from the env contract + signal flag
        ckpt = api.Checkpointer(run_dir, keep=2)     # atomic, checksummed, retained, async commits
        sampler = api.resumable_sampler(len(data), batch_size, seed)   # the global-step batch plan
        state = ckpt.load_latest()                   # newest verified checkpoint (+ this rank's RNG) or None
        for step, idx in sampler.batches(epoch, start_step): ...
            if api.preemption_requested(step):       # agreed by every rank at this same step (+ heartbeat)
                ckpt.save(step, state)
                sys.exit(api.PREEMPTED)

A loop that asks preemption_requested() every step also leaves the launcher's heartbeat (what
`python -m launch.local status` and the hang watchdog read); a loop that does not calls
`api.heartbeat(step)` itself (torchlaunch.jobs.progress.heartbeat: one clock read, no host sync).

Exit codes: 0 done, 1 failure, 2 bad input, 75 preempted with a checkpoint committed. Inside
`with api.setup()`, a BadInput becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from torchlaunch import compat, rundir
from torchlaunch import status as _status
from torchlaunch.core import checkpoint as _ckpt
from torchlaunch.core import dist as _dist
from torchlaunch.core.preemption import PreemptionWatcher, StepAgreement
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.core.step_drop import StepDrop, applies
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED, BadInput
from torchlaunch.jobs.progress import heartbeat
from torchlaunch.stop_signals import STOP_SIGNAL_NAMES, loader_worker_init

__all__ = [
    "BAD_INPUT",
    "FAILURE",
    "OK",
    "PREEMPTED",
    "BadInput",
    "Checkpointer",
    "Context",
    "ResumableSampler",
    "heartbeat",
    "loader_worker_init",
    "preemption_requested",
    "resumable_sampler",
    "setup",
    "step_drop",
    "teardown",
]

SIGNALS = STOP_SIGNAL_NAMES
"""What Kubernetes, Slurm (--signal), a terminal and a Ctrl-C send before a stop: the worker's defaults."""

KIND = "torchlaunch.api"
"""Marks checkpoints written by Checkpointer (the built-in worker's hold its own payload)."""


@dataclass(frozen=True)
class Context:
    """Who this process is in the job. Use it as a context manager to tear down on the way out."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dist: _dist.DistContext = field(repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.dist.distributed

    def __enter__(self) -> Context:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, BadInput):
            teardown(clean=False)  # maybe raised on this rank alone: no barrier its peers never reach
            _exit_bad_input(exc)
        session = _session
        if exc is None and session is not None and not session.stopping:
            _status.declare_finished()  # the with block ran to its end with no preemption asked for
        teardown(clean=exc is None or isinstance(exc, SystemExit))


@dataclass
class _Session:
    ctx: Context
    watcher: PreemptionWatcher
    stopping: bool = False
    calls: int = 0
    """preemption_requested() calls so far: the heartbeat's step when the caller passes none."""
    checkpointers: list[Checkpointer] = field(default_factory=list)
    agreement: StepAgreement | None = None
    """preemption_requested()'s lagged all-reduces (created at the first call)."""


_session: _Session | None = None


def setup(
    timeout_s: float = 300.0, backend: str = "auto", signals: Sequence[str] = SIGNALS, pin_cpus: bool = False
) -> Context:
    """Join the process group the launcher described (RANK, WORLD_SIZE, ... ; none: a single process)
    and install the flag-only preemption handlers. Call once, first thing; a second call returns the
    same context. A broken environment is bad input: one line on stderr, exit 2."""
    global _session
    if _session is not None:
        return _session.ctx
    watcher = PreemptionWatcher(list(signals))  # first: a signal during start-up is not lost
    try:
        d = _dist.setup(timeout_s, backend, pin_cpus)
    except BadInput as e:
        watcher.restore()
        _exit_bad_input(e)
    ctx = Context(d.rank, d.world_size, d.local_rank, d.device, d)
    _session = _Session(ctx, watcher)
    return ctx


def _exit_bad_input(error: BadInput) -> None:
    """Bad input ends the program with one line and exit 2. Under launch.local the BadInput goes on
    to its program runner (launch.program), which records the reason for the launcher to print once
    for all ranks, exactly as for the built-in worker."""
    if _status.launched() and _status.folder() is not None:
        raise error
    print((str(error).splitlines() or ["bad input"])[0], file=sys.stderr, flush=True)
    raise SystemExit(BAD_INPUT) from None


def teardown(clean: bool = True) -> None:
    """Wait for pending checkpoint commits, restore the signal handlers, leave the process group.
    `clean=False` after a failure or bad input skips the closing barrier (a peer may be gone)."""
    global _session
    session, _session = _session, None
    if session is None:
        return
    try:
        for checkpointer in session.checkpointers:
            checkpointer.wait()
            if checkpointer._saved is not None:
                _status.note_committed(checkpointer._saved)  # durable now: the launcher may say so
        if clean and session.agreement is not None:
            session.agreement.drain()  # every rank posted the same calls: none is left in flight
    finally:
        session.watcher.restore()
        _dist.teardown(session.ctx.dist, clean=clean)


def _active() -> _Session:
    if _session is None:
        raise RuntimeError(
            "call torchlaunch.api.setup() first (it joins the process group and installs the preemption handlers)"
        )
    return _session


AGREEMENT_LAG = 2
"""Calls between a rank posting its flag and every rank reading the agreed value (the built-in
Trainer's lag): the all-reduce runs behind the step's work, so asking every step never syncs the device."""


def preemption_requested(step: int | None = None) -> bool:
    """True on every rank when any rank got a preemption signal, at the same call on every rank, so every
    rank must call it once per step. Then save (every rank) and exit with PREEMPTED.

    When the answer arrives: with several ranks each call starts a non-blocking all-reduce of this
    rank's flag and reads the one started AGREEMENT_LAG (2) calls earlier, as the built-in Trainer does,
    so a signal is answered True at most 2 calls after it arrived and no call waits for the device;
    in a single process (no process group) the answer is the flag itself, at once.

    Also the per-step heartbeat: `step` (a Python int, the steps done) is what the launcher's status
    and watchdog show; without it, the number of calls so far."""
    session = _active()
    session.calls += 1
    heartbeat(session.calls if step is None else int(step))
    if session.agreement is None:
        session.agreement = StepAgreement(session.ctx.dist)
    session.agreement.post(session.calls, session.watcher.requested)
    lag = AGREEMENT_LAG if session.ctx.dist.distributed else 0
    requested = session.agreement.read(session.calls - lag)
    session.stopping = session.stopping or requested
    return session.stopping


def step_drop(model: torch.nn.Module) -> StepDrop:
    """The built-in trainer's "drop the step in flight" for your loop (torchlaunch/core/step_drop.py):
    a stop that arrives mid-step abandons the step on every rank alike, and you save the last finished
    step at once, instead of finishing a long step the platform's grace may not leave time for:

        drop = api.step_drop(model)                   # once, after setup() and the model's construction
        for step in range(start, total):
            drop.begin(step + 1)
            for i, (x, y) in enumerate(micro_batches):
                if drop.leave() and i < len(micro_batches) - 1:
                    continue                          # the last one still runs: it holds DDP's collectives
                loss_fn(ddp(x), y).backward()
            if drop.agreed():                         # the same answer on every rank
                drop.restore(); optimizer.zero_grad()
                ckpt.save(step, state); sys.exit(api.PREEMPTED)   # `step` steps are done: the last finished
            optimizer.step(); optimizer.zero_grad()

    It needs gloo (or no process group): under NCCL, leave() never asks to leave and
    preemption_requested() stops the loop at a step boundary as before. Only the torch (and CUDA)
    generators and the model's buffers are put back: a step that draws from numpy or Python's random
    restores them itself."""
    session = _active()
    d = session.ctx.dist
    if not applies(d):
        return StepDrop(d, model, lambda: False, None)
    store = compat.default_store() if d.distributed else None
    return StepDrop(d, model, lambda: session.watcher.requested, store)


class Checkpointer:
    """Checkpoints of a user script under RUN_DIR/checkpoints/step-NNNNNNNNN, written by the built-in
    worker's own Checkpointer (core.checkpoint): atomic commit, checksum, retention of the newest `keep`
    that verify, async saves through reused snapshot buffers, one on-disk format (the user's state is
    the payload's "state" entry).

    save() is collective (every rank calls it: each rank's RNG states go into the checkpoint); rank 0
    commits, and a failed commit raises CheckpointError on every rank. Saves after
    preemption_requested() returned True, and `synchronous=True` ones, return only once the commit is
    durable on every rank; other saves commit in the background, and the process never ends before a
    pending commit has finished (teardown and an atexit hook wait)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        keep: int = 2,
        synchronous: bool = False,
        map_location: str | torch.device = "cpu",
    ) -> None:
        session = _active()
        self._ctx = session.ctx
        if not isinstance(keep, int) or keep < 1:
            raise BadInput(
                f"api error: Checkpointer keep={keep!r}: must be an integer >= 1 "
                "(the number of newest checkpoints to keep, e.g. keep=2)"
            )
        self.root = rundir.checkpoints(Path(run_dir).expanduser())
        self.keep, self.synchronous, self.map_location = keep, synchronous, map_location
        self.step: int | None = None
        """The step of the checkpoint load_latest() returned (None: none yet)."""
        _dist.agreed(self._ctx.dist, lambda: _check_writable(self.root) if self._ctx.is_main else None)
        self._core = _ckpt.Checkpointer(self._ctx.dist, self.root, keep, KIND, map_location=map_location)
        session.checkpointers.append(self)
        self._saved: int | None = None
        atexit.register(self._wait_at_exit)

    def load_latest(self) -> dict[str, Any] | None:
        """The state of the newest checkpoint that verifies (a corrupt one is skipped with a warning),
        loaded with weights_only=True, or None. Also restores this rank's RNG states (torch, CUDA,
        numpy, python) as they were at save, so call it last, just before the training loop."""
        loaded = self._core.load_latest("auto", restore=False)
        if loaded is None:
            return None
        if loaded.kind != KIND:
            raise BadInput(
                f"api error: Checkpointer run_dir: {loaded.path} was not written by api.Checkpointer "
                "(the built-in worker's checkpoints hold its own state; use another run_dir)"
            )
        self._core.restore_rng(loaded.state)
        self.step = loaded.step
        return loaded.state["state"]

    def save(self, step: int, state: dict[str, Any], synchronous: bool | None = None) -> None:
        """Checkpoint `state` (tensors, nested dicts/lists, module/optimizer state_dicts, numbers) as
        step `step`. Every rank calls it at the same step; only rank 0's `state` is written."""
        session = _session
        sync = self.synchronous if synchronous is None else synchronous
        sync = sync or (session is not None and session.stopping)
        self._core.save(int(step), {"state": state}, synchronous=sync)
        self._saved = int(step)

    def wait(self) -> _ckpt.CommitInfo | None:
        """Block until this process's pending commit is durable (rank 0; other ranks return None)."""
        return self._core.wait()

    def _wait_at_exit(self) -> None:
        try:
            self._core.wait()
        except BaseException as e:  # noqa: BLE001 - the exit code must not claim a commit that failed
            print(
                f"checkpoint error at exit: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(BAD_INPUT if isinstance(e, BadInput) else FAILURE)  # a full disk: not retried


def _check_writable(root: Path) -> None:
    """Rank 0 proves it can create files under root before any training time is spent."""
    probe = root / f".write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BadInput(
            f"api error: Checkpointer run_dir: cannot write {root}: {e.strerror or e} "
            "(pass a writable folder every rank can reach)"
        ) from None


@dataclass(frozen=True)
class ResumableSampler:
    """The global-step batch plan: per epoch a permutation fixed by (seed, epoch); global step s takes
    samples s*B:(s+1)*B of it and each rank its contiguous share. A pure function of (seed, epoch,
    step, rank, world size), so a resumed run continues the same sample order without replaying.

    Any world size from 1 to B works: when W does not divide B the shares differ by one sample
    (`shares`), and a rank's loss needs a weight so that DDP's average over the ranks is the mean over
    the global batch:

        loss = criterion(model(x), y) * sampler.loss_weight   # mean loss over this rank's share

    (`loss_weight` is share * W / B: exactly 1.0 when W divides B, so an even run is unchanged; with a
    summed loss use W / B instead; accumulating micro-batches, weight each one's mean loss by
    count * W / B.)"""

    plan: BatchPlan

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (the last partial batch is dropped)."""
        return self.plan.steps_per_epoch

    @property
    def batch_size(self) -> int:
        """This rank's share of a global batch (see shares)."""
        return self.plan.per_rank

    @property
    def shares(self) -> tuple[int, ...]:
        """Every rank's samples per global step: differ by at most one, the larger ones first."""
        return self.plan.shares

    @property
    def loss_weight(self) -> float:
        """Multiply this rank's MEAN loss over its share by this (share * W / B) so the gradient DDP
        averages is the global batch's mean; 1.0 whenever the world size divides the batch."""
        return float(self.plan.loss_weight(self.plan.per_rank))

    def locate(self, global_step: int) -> tuple[int, int]:
        """(epoch, step in that epoch) of the next batch after `global_step` steps."""
        return divmod(global_step, self.steps_per_epoch)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        """(step in epoch, this rank's sample indices) from `start_step` to the epoch's end."""
        perm = self.plan.permutation(epoch)
        share = self.plan.rank_slice()
        for step in range(start_step, self.steps_per_epoch):
            yield step, self.plan.step_indices(perm, step)[share]


def resumable_sampler(
    dataset_len: int, batch_size: int, seed: int, *, rank: int | None = None, world_size: int | None = None
) -> ResumableSampler:
    """The batch plan for a map-style dataset of `dataset_len` samples. `batch_size` is the GLOBAL
    batch (split over the ranks, unevenly when the world size does not divide it: weight the loss by
    `loss_weight`); rank and world size default to setup()'s (else 0 of 1)."""
    ctx = _session.ctx if _session is not None else None
    rank = (ctx.rank if ctx else 0) if rank is None else rank
    world_size = (ctx.world_size if ctx else 1) if world_size is None else world_size
    if batch_size < max(1, world_size):
        raise BadInput(
            f"api error: resumable_sampler batch_size={batch_size}: the global batch must be at least "
            f"the world size {world_size}, or a rank gets no samples (e.g. {world_size * 32})"
        )
    if dataset_len < batch_size:
        raise BadInput(
            f"api error: resumable_sampler dataset_len={dataset_len} is smaller than "
            f"batch_size={batch_size} (use a smaller batch or a larger dataset)"
        )
    return ResumableSampler(BatchPlan(dataset_len, batch_size, seed, rank, world_size))
