"""The run-dir rendezvous (rdzv_file.py) as torch's elastic agent sees it: a RendezvousBackend under
torch's own DynamicRendezvousHandler, and the handler's registration as `--rdzv-backend torchlaunch-rundir`.

Imported only by the torchrun wrapper (torchlaunch.launch.torchrun), the one launcher-side process that
imports torch: the handler's round logic (join, last call, heartbeats, dead nodes) stays torch's, only
where its state and per-round store live changes.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import FileStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler

from torchlaunch import roads
from torchlaunch.launch import rdzv_file

READ_TIMEOUT_S = 60
"""How long a read of the per-round store waits (c10d's read_timeout default for its TCP store)."""


class RunDirBackend(RendezvousBackend):
    """get_state / set_state over rdzv_file.StateFile: compare-and-set with the seal as the token."""

    def __init__(self, state: rdzv_file.StateFile) -> None:
        self._state = state

    @property
    def name(self) -> str:
        return rdzv_file.BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._state.get()

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        return self._state.compare_set(state, token)


def create(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for torchrun's parameters: the endpoint is the run dir, the id and the launcher's
    incarnation name the files, the run's secret seals the state."""
    run_dir = params.endpoint
    name = rdzv_file.name_of(params.run_id, str(params.get(rdzv_file.INCARNATION, "") or ""))
    key = roads.RESTART.prepare(run_dir).rendezvous_key
    path, folder = rdzv_file.store_path(run_dir, name)
    _held.append(folder)  # the store's path runs through this descriptor for the agent's life
    store = FileStore(path, -1)
    store.set_timeout(timedelta(seconds=READ_TIMEOUT_S))
    return create_handler(store, RunDirBackend(rdzv_file.StateFile(run_dir, name, key)), params)


_held: list[int] = []


def register(argv: list[str]) -> None:
    """Make `--rdzv-backend torchlaunch-rundir` known to torchrun when `argv` asks for it."""
    if rdzv_file.BACKEND in argv:
        registry.register(rdzv_file.BACKEND, create)
