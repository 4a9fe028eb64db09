"""The one Checkpointer: collective save and load_latest over the store, for the built-in Trainer and the API.

Every save is collective: each rank's RNG states are gathered into the checkpoint, and rank 0 commits.
A failed commit is agreed: a synchronous save (and the next save after a failed background one) raises
CheckpointError on every rank together, so no rank exits "preempted, checkpoint committed" while rank 0
could not commit, and none waits on a peer that left. Background saves copy the state into reused
snapshot buffers (snapshot.py) and commit on one writer thread; each commit is followed by retention.

On-disk format (format_version 1), one dict per state.pt: the envelope keys below, plus the owner's
payload at top level (the built-in worker: model, optimizer, progress, ...; the API: "state"); a
payload's "versions" entries are added to the envelope's, and a payload may carry format_version (so it
loads on its own), which the envelope sets.
Checkpoints without "kind" or "step" were written by the built-in worker before the envelope named them.
"""

from __future__ import annotations

import platform
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchlaunch.core.checkpoint import shares, store
from torchlaunch.core.checkpoint.formats import get_format, is_sharded
from torchlaunch.core.checkpoint.snapshot import AsyncWriter, SnapshotBuffers
from torchlaunch.core.checkpoint.store import CheckpointError, CommitInfo
from torchlaunch.core.dist import DistContext, agreed, broadcast_json, gather_json
from torchlaunch.core.rng_wire import rank_news, rng_to_json
from torchlaunch.exit_codes import BadInput

WORKER_KIND = "torchlaunch.worker"
"""The built-in worker's checkpoints (also those written before the envelope named a kind)."""

ENVELOPE = ("format_version", "kind", "step", "world_size", "rng", "versions")


@dataclass(frozen=True)
class Loaded:
    """A checkpoint load_latest() chose: where, which step, the whole state (envelope + payload)."""

    path: Path
    step: int
    kind: str
    state: dict[str, Any]


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states (torch, CUDA, numpy, python) in weights_only-loadable types."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back what capture_rng() took, so the next random draw is the one the saved run made."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def restore_rank_rng(state: dict[str, Any], ctx: DistContext) -> bool:
    """Restore this rank's RNG states from a checkpoint; False (nothing restored) when it was saved by
    another number of ranks: those ranks no longer exist, the caller seeds fresh streams."""
    if state.get("world_size") != ctx.world_size:
        return False
    restore_rng(state["rng"][ctx.rank], ctx.device)
    return True


def _tensor(value: Any, dtype: torch.dtype, numel: int | None = None) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == dtype
        and value.dim() == 1
        and (numel is None or value.numel() == numel)
    )


def rng_problem(rng: Any) -> str | None:
    """Why one rank's saved RNG states (capture_rng's layout) cannot be restored, or None."""
    if not isinstance(rng, dict):
        return "not a mapping"
    if not _tensor(rng.get("torch"), torch.uint8, torch.get_rng_state().numel()):
        return "torch state is not the generator's byte tensor"
    cuda = rng.get("cuda")
    if cuda is not None and not _tensor(cuda, torch.uint8):
        return "cuda state is not a byte tensor"
    n = rng.get("numpy")
    if not (
        isinstance(n, list | tuple)
        and len(n) == 5
        and n[0] == "MT19937"
        and _tensor(n[1], torch.int64, 624)
        and all(isinstance(v, int) for v in n[2:4])
        and isinstance(n[4], float)
    ):
        return "numpy state is not MT19937's"
    py = rng.get("python")
    if not (
        isinstance(py, list | tuple)
        and len(py) == 3
        and isinstance(py[1], list | tuple)
        and len(py[1]) == 625
        and all(isinstance(v, int) for v in py[1])
    ):
        return "python state is not random.getstate()'s"
    return None


def envelope_problem(state: dict[str, Any]) -> str | None:
    """Why a loaded checkpoint's envelope (step, world size, RNG states) is unusable, or None;
    checkpoints written before the envelope named them have no step/world size to check."""
    step = state.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step is {type(step).__name__}, not a step number"
    if "world_size" not in state and "rng" not in state:
        return None
    world, rng = state.get("world_size"), state.get("rng")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        return "world_size is not a positive integer"
    if not isinstance(rng, list) or len(rng) != world:
        return f"rng holds no state for each of its {world} ranks"
    for rank, entry in enumerate(rng):
        problem = rng_problem(entry)
        if problem is not None:
            return f"rank {rank}'s RNG states: {problem}"
    return None


def kind_of(state: dict[str, Any]) -> str:
    return str(state.get("kind", WORKER_KIND))


def step_of(state: dict[str, Any], path: Path) -> int:
    if "step" in state:
        return int(state["step"])
    progress = state.get("progress")
    if isinstance(progress, dict) and "global_step" in progress:
        return int(progress["global_step"])
    return store.parse_step(path.name) or 0


def _versions(extra: Any) -> dict[str, str]:
    """torch and python versions, plus what the owner adds (the worker: its own version)."""
    versions = {"torch": str(torch.__version__), "python": platform.python_version()}
    return {**versions, **(extra if isinstance(extra, dict) else {})}


class Checkpointer:
    """Collective checkpoints of one run under `root` (RUN_DIR/checkpoints).

    `writer` and `snapshots` may be passed in by an owner that keeps them across Checkpointer objects
    (the Trainer waits on its writer directly)."""

    def __init__(
        self,
        ctx: DistContext,
        root: Path,
        keep: int,
        kind: str,
        *,
        map_location: str | torch.device = "cpu",
        metric: str = "val_acc",
        writer: AsyncWriter | None = None,
        snapshots: SnapshotBuffers | None = None,
        check_state: Callable[[dict[str, Any]], str | None] | None = None,
        format_name: str | None = None,
    ) -> None:
        """`check_state(state)`: the owner's check of its payload (None: usable), so a checksum-valid
        state that cannot be restored is skipped for the previous checkpoint like a corrupt one.
        `format_name`: the checkpoint format saves write (None: the single file); loads read whatever
        format each folder's marker names."""
        self.ctx, self.root, self.keep, self.kind = ctx, Path(root), keep, kind
        self.format_name = format_name
        self.check_state = check_state
        self.map_location, self.metric = map_location, metric
        self.writer = writer if writer is not None else AsyncWriter()
        self.snapshots = snapshots if snapshots is not None else SnapshotBuffers()

    # ------------------------------------------------------------------ load

    def load_latest(self, resume: str = "auto", restore: bool = True) -> Loaded | None:
        """The checkpoint to continue from, or None (a fresh run). `resume`: auto (the newest that
        verifies and loads), never, or a path (see store.resolve_resume). Rank 0 chooses, repairs what
        a crashed save left, and moves folders that do not verify or load to quarantine (one warning
        each, naming it); every rank then loads the chosen folder. `restore`: put back this rank's RNG
        states when the world size is unchanged (else the caller seeds)."""
        ctx = self.ctx
        self.writer.wait()  # a commit of this process is never mistaken for a stale leftover
        found: tuple[Path, dict[str, Any]] | None = None

        def choose() -> str | None:
            nonlocal found
            store.check_root(self.root)
            store.ensure_run(self.root)
            store.clean_stale(self.root)
            if resume == "auto":
                found = store.find_latest(self.root, self.map_location, move_invalid=True, check=self._usable)
            else:
                found = store.resolve_resume(resume, self.root, self.map_location, check=self._usable)
            return str(found[0]) if found else None

        chosen = agreed(ctx, lambda: choose() if ctx.is_main else None)
        chosen = broadcast_json(ctx, chosen, kinds=(str, type(None)))
        if chosen is None:
            return None
        path = Path(chosen)
        state = found[1] if found is not None else store.load_state(path, self.map_location)
        if restore and kind_of(state) == self.kind:
            self.restore_rng(state)
        return Loaded(path, step_of(state, path), kind_of(state), state)

    def _usable(self, path: Path, state: dict[str, Any]) -> str | None:
        """Why a loaded state cannot be continued from (its envelope, then the owner's payload), or None."""
        problem = envelope_problem(state)
        placed = store.parse_step(path.name)  # the marker's step agrees with it (store.verify)
        if problem is None and "step" in state and placed is not None and state["step"] != placed:
            problem = f"its state is of step {state['step']}, its folder of step {placed}"
        if problem is None and self.check_state is not None and kind_of(state) == self.kind:
            problem = self.check_state(state)
        return problem

    def restore_rng(self, state: dict[str, Any]) -> bool:
        """This rank's RNG states from `state`; on a new world size a warning (rank 0) and False."""
        if restore_rank_rng(state, self.ctx):
            return True
        if self.ctx.is_main:
            store.warn(
                f"saved by {state.get('world_size')} ranks, now {self.ctx.world_size}: RNG states not "
                "restored (each rank keeps the seeding it has)"
            )
        return False

    # ------------------------------------------------------------------ save

    @property
    def wants_payload(self) -> bool:
        """Whether this rank's save() needs the payload: rank 0 always, every rank for a sharded format
        (each writes its share); the others may pass {}."""
        return self.ctx.is_main or is_sharded(get_format(self.format_name))

    def save(
        self,
        step: int,
        payload: dict[str, Any],
        meta: dict[str, Any] | None = None,
        *,
        synchronous: bool = False,
        final: bool = False,
        replace: bool = False,
        commit_guard: store.CommitGuard | None = None,
    ) -> CommitInfo | None:
        """Checkpoint `payload` as step `step`; every rank calls it at the same step, rank 0 writes.

        synchronous: returns once the commit is durable, or raises CheckpointError on every rank.
        Otherwise a snapshot (reused buffers) is committed in the background; `final` commits the live
        tensors in the background without a snapshot (nothing changes them any more; the caller waits
        on self.writer). A background failure is raised on every rank at the next save. `commit_guard`:
        store.write_checkpoint's (live mode's fence). A sharded format (formats.ShardedFormat) saves
        synchronously on every rank, each writing its share (shares.py): a collective cannot run on a
        background thread beside training's."""
        ctx = self.ctx
        fmt = get_format(self.format_name)
        sharded = is_sharded(fmt)
        synchronous = synchronous or sharded
        clash = sorted(set(payload) & set(ENVELOPE) - {"versions", "format_version"})
        if clash:
            raise ValueError(f"checkpoint payload keys {clash} are reserved for the envelope")
        previous: str | None = None
        refused: str | None = None
        if ctx.is_main:
            previous = self._settle()
            try:
                store.check_root(self.root)  # bad input on every rank, before anything is written
            except BadInput as e:
                refused = str(e)
        gathered = [rank_news(v) for v in gather_json(ctx, [rng_to_json(capture_rng(ctx.device)), previous, refused])]
        refusals = [r for _, _, r in gathered if r]
        if refusals:
            raise BadInput(refusals[0])
        failed = [e for _, e, _ in gathered if e]
        if failed:
            raise store.checkpoint_error(str(failed[0]))
        if not ctx.is_main and not synchronous:
            return None
        info: CommitInfo | None = None
        error: str | None = None
        if not ctx.is_main and sharded:  # a peer writes its share of the same state
            try:
                shares.follow(ctx, fmt, self.root, self._state(step, payload, [r for r, _, _ in gathered]))  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - agreed below with every rank
                error = _message(e)
        elif ctx.is_main:
            state = self._state(step, payload, [r for r, _, _ in gathered])
            marker = dict(meta or {}, world_size=ctx.world_size, kind=self.kind)

            def commit(snapshot: dict[str, Any], write_shares: store.WriteShares | None = None) -> CommitInfo:
                done = store.write_checkpoint(
                    self.root,
                    int(step),
                    snapshot,
                    marker,
                    replace=replace,
                    format_name=self.format_name,
                    commit_guard=commit_guard,
                    write_shares=write_shares,
                )
                store.retain(self.root, self.keep, done.path, self.metric)
                return done

            if final and not synchronous:
                self.writer.submit(lambda: commit(state))
                return None
            if not synchronous:
                snapshot = self.snapshots.take(state)  # training mutates the live tensors in place
                try:
                    self.writer.submit(lambda: snapshot.write_with(commit))
                except BaseException:
                    snapshot.release()
                    raise
                return None
            lead = shares.Lead(ctx, fmt, state) if sharded else None  # type: ignore[arg-type]
            try:
                info = commit(state, lead.write if lead is not None else None)
            except Exception as e:  # noqa: BLE001 - every rank raises it, none waits on a dead peer
                error = _message(e)
            finally:
                if lead is not None:
                    lead.close()
        errors = [m for m in gather_json(ctx, error, kinds=(str, type(None))) if m]
        if errors:
            raise store.checkpoint_error(str(errors[0]))
        return info

    def _state(self, step: int, payload: dict[str, Any], rng: list[Any]) -> dict[str, Any]:
        """The checkpoint's whole state: the payload in the envelope (every rank's RNG states)."""
        return {
            **payload,
            "format_version": store.FORMAT_VERSION,
            "kind": self.kind,
            "step": int(step),
            "world_size": self.ctx.world_size,
            "rng": rng,
            "versions": _versions(payload.get("versions")),
        }

    def _settle(self) -> str | None:
        """Rank 0: wait for the background commit in flight; its failure as one message, or None."""
        try:
            self.writer.wait()
        except Exception as e:  # noqa: BLE001 - agreed with every rank by save()
            return _message(e)
        return None

    def wait(self) -> CommitInfo | None:
        """Block until this process's pending commit is durable (rank 0; other ranks return None)."""
        return self.writer.wait()


def _message(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"checkpoint error: {type(e).__name__}: {e}"
