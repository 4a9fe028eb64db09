"""The one registry of recovery roads: what a run does when it loses a rank, as the launchers and the
worker meet it (issue #54: one path in the code; the launchers reach live recovery through here).

Two roads are built in, looked up by name as the schedulers are (torchlaunch/jobs/schedulers.py, after
TorchX's scheduler registry):
- "restart": torchrun's static group. A lost rank stops every rank; torchrun's --max-restarts, a
  requeue or the same command again resumes from the newest checkpoint. Defined here: it needs nothing
  of its own beyond the run's secret (for a rendezvous in the run dir).
- "live": recovery.live, the default of every multi-rank road that can be live. A lost rank or node
  costs its peers a regroup in place. Its object is torchlaunch.live.road:ROAD, in live recovery's
  own home; its node side is the agent's (torchlaunch.agent.live), its worker side worker/groups/live.py.

A launcher asks `choose(recovery.live, possible)` for the road a launch takes (the newest registered
road that takes it; the restart road takes every launch) and reads what it needs of the road: whether
a lost rank regroups in place, the membership service's module, the worker's group, the run dir's
preparation, and, for the live road, its launch-side parts (fence, placement, presence, pulse,
minimum, runkey). Nothing outside torchlaunch/live/ and the worker's live group imports
torchlaunch.live's modules itself (tests/unit/test_seams.py). Entries are "module:attribute" lines
loaded on the first question, so this module imports nothing of the project (a launcher that asks
loads only the road it gets, and no torch). Stdlib only.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol


class Road(Protocol):
    name: str
    """What the registry, the road line's reader and the worker call it: "restart", "live"."""

    regroups: bool
    """True: a lost rank costs its peers a regroup in place (the agent's node side, the Slurm task's and
    the pods' place a membership service); False: every rank stops and the run resumes from a checkpoint."""

    service: str
    """The membership service's module (run as `python -m`: by the live agent, a Slurm task, a Kubernetes
    Deployment); "" for a road without one."""

    group: str
    """"module:function" forming a rank's training group on this road, function(cfg, ctx, attempt), loaded
    in the rank (torchlaunch.worker.groups.form): the module is named, never imported, below the worker."""

    def takes(self, live: Any, possible: bool) -> bool:
        """Whether a launch takes this road under recovery.live=`live` (auto, true or false), `possible`
        saying whether the launch's road can be live at all."""

    def insisted(self, live: Any) -> bool:
        """Whether the user asked for this road by name (recovery.live=true for the live road): a launch
        that cannot take it refuses it (exit 2, one line) instead of taking another quietly."""

    def declined(self, live: Any) -> bool:
        """Whether the user turned this road off (recovery.live=false for the live road)."""

    def prepare(self, run_dir: str) -> Any:
        """Ready the run dir before any rank starts: the run's secret, made or checked (BadInput, one
        line, when it is not this run's); returns it."""


class Restart:
    """torchrun's static group: the road every launch can take, and the one the others fall back on."""

    name = "restart"
    regroups = False
    service = ""
    group = "torchlaunch.worker.groups.fixed:form"

    WAY_OUT = "recovery.live=false"
    """This road's reason in a road line when the user chose it."""
    PROGRAM_WHY = "your own program cannot regroup in process"
    """This road's reason for a user's program: torchrun's contract starts its ranks again, it has no
    live group to re-form."""

    def takes(self, live: Any, possible: bool) -> bool:
        return True

    def insisted(self, live: Any) -> bool:
        return live is False

    def declined(self, live: Any) -> bool:
        return False

    def prepare(self, run_dir: str) -> Any:
        from torchlaunch.live import runkey  # the run's secret has one owner, live/runkey.py (torch-free)

        return runkey.load(run_dir)


RESTART = Restart()

BUILTIN = ("torchlaunch.roads:RESTART", "torchlaunch.live.road:ROAD")
"""The roads this package ships, one "module:attribute" line each; the fallback first (choose asks the
newest first)."""

_ROADS: dict[str, Road] = {}
_BUILTIN_NAMES: set[str] = set()
_LOADED = False


def load(target: str) -> Any:
    """The object a "module:attribute" line names (a road, or a road's group former)."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for target in BUILTIN:
        road = load(target)
        _ROADS[road.name] = road
    _BUILTIN_NAMES.update(_ROADS)


def register(road: Road) -> Road:
    """Add (or replace) a road; choose asks the newest first. A built-in road's name is refused."""
    _load_all()
    if road.name in _BUILTIN_NAMES and _ROADS.get(road.name) is not road:
        raise ValueError(f"road {road.name!r} is built in and cannot be replaced")
    _ROADS.pop(road.name, None)
    _ROADS[road.name] = road
    return road


def unregister(name: str) -> None:
    _load_all()
    if name not in _BUILTIN_NAMES:
        _ROADS.pop(name, None)


def names() -> tuple[str, ...]:
    _load_all()
    return tuple(_ROADS)


def get(name: str) -> Any:
    """The road of this name (KeyError for a name no road has). Typed Any: a launcher reads the parts of
    the road it asked for by name (the live road's fence, placement, ...), which the protocol leaves open."""
    _load_all()
    return _ROADS[name]


def choose(live: Any, possible: bool) -> Any:
    """The road a launch takes under recovery.live=`live`, its road able to be live (`possible`) or not:
    the newest registered road that takes it, the restart road when no other does."""
    _load_all()
    for road in reversed(_ROADS.values()):
        if road.takes(live, possible):
            return road
    return RESTART
