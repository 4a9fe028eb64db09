"""The collective write of a sharded checkpoint format (formats.ShardedFormat): each rank its share.

Rank 0 runs the store's commit protocol (store.write_checkpoint: hidden temp folder, atomic rename,
COMMITTED.json) and, where the format would write, names the temp folder to every rank; each rank
writes its share into that folder, then rank 0 gathers every rank's outcome. Only when every share is
durable does rank 0 write its own part and commit; a share that failed on any rank fails the commit
(the temp folder is removed, the previous checkpoint kept), and the Checkpointer raises it on every rank.

The collectives, in the same order on every rank: one broadcast (the temp folder's name, or None when
rank 0 commits nothing: a failure before the folder existed, or the step is committed already), then,
when a folder was named, one gather of the ranks' outcomes. What peers send is JSON, never a pickle.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchlaunch import rundir
from torchlaunch.core.checkpoint.discovery import TMP_PREFIX
from torchlaunch.core.checkpoint.formats import ShardedFormat
from torchlaunch.core.dist import DistContext, broadcast_json, gather_json


class ShareFailed(OSError):
    """A rank could not write its share; its errno is the rank's own (a full disk stays a storage error)."""


def _outcome(write: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """{"share": the format's fields} or {"error": one line, "errno": the OSError's errno or None}."""
    try:
        return {"share": write()}
    except Exception as e:  # noqa: BLE001 - every failure is reported to rank 0, which fails the commit
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        code = cause.errno if isinstance(cause, OSError) and isinstance(cause.errno, int) else None
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}", "errno": code}


class Lead:
    """Rank 0's side. `write` is store.write_checkpoint's write_shares; `close` (always called once
    the commit is over) names no folder to the peers when `write` never ran."""

    def __init__(self, ctx: DistContext, fmt: ShardedFormat, state: dict[str, Any]) -> None:
        self.ctx, self.fmt, self.state = ctx, fmt, state
        self.announced = False

    def write(self, folder: Path, name: str) -> dict[str, Any]:
        self.announced = True
        broadcast_json(self.ctx, name)
        own = _outcome(lambda: self.fmt.write_share(folder, self.state, 0, self.ctx.world_size))
        outcomes = gather_json(self.ctx, own, kinds=(dict,))
        for rank, outcome in enumerate(outcomes):
            if "share" not in outcome or not isinstance(outcome["share"], dict):
                code = outcome.get("errno")
                raise ShareFailed(
                    code if type(code) is int else errno.EIO,
                    f"rank {rank} could not write its share: {str(outcome.get('error'))[:600]}",
                )
        try:
            return self.fmt.finish(folder, self.state, [outcome["share"] for outcome in outcomes])
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - an OSError, so the store removes the temp folder
            raise ShareFailed(errno.EIO, f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        if not self.announced:
            self.announced = True
            broadcast_json(self.ctx, None)


def follow(ctx: DistContext, fmt: ShardedFormat, root: Path, state: dict[str, Any]) -> None:
    """Every rank but 0: write this rank's share into the folder rank 0 names (if any), report back."""
    name = broadcast_json(ctx, None, kinds=(str, type(None)))
    if name is None:
        return
    gather_json(ctx, _outcome(lambda: _write_in(root, str(name), fmt, state, ctx)))


def _write_in(root: Path, name: str, fmt: ShardedFormat, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
    """The share written in ROOT/name, that folder opened without following a link (here too the
    format is handed a path pinned to the folder's descriptor, as the store does on rank 0)."""
    if not name.startswith(TMP_PREFIX) or "/" in name or name in (".", ".."):
        raise ValueError(f"rank 0 named {name[:80]!r}, not a temp folder")
    held = rundir.open_folder(root)
    try:
        folder = rundir.open_folder(name, dir_fd=held)
        try:
            pinned = rundir.folder_path(folder)
            if pinned is None:
                pinned = root / name
                if not (rundir.same_folder(root, held) and rundir.same_folder(pinned, folder)):
                    raise OSError(errno.ELOOP, f"{root / name} was replaced while the run trained")
            return fmt.write_share(pinned, state, ctx.rank, ctx.world_size)
        finally:
            os.close(folder)
    finally:
        os.close(held)
