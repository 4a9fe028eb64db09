"""The run dir's lease that places a live job's membership service on one of its nodes
(live/placement.py): one holder per generation, renewed while it lives, taken over once it
lapses on the reader's own clock, stepped down from before a reader may take it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from torchlaunch.live import placement


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Agent:
    """One node agent's lease with what it was told: served (with the previous lease's fields), stopped."""

    def __init__(self, run_dir: Path, name: str, clock: Clock, lease_s: float = 1.0) -> None:
        self.served: list[dict] = []
        self.stops = 0
        self.lease = placement.Lease(
            run_dir,
            name,
            f"http://{name}:29510",
            lease_s,
            self.served.append,
            self._stop,
            clock=clock,
            extra={"nproc": 2},
        )

    def _stop(self) -> None:
        self.stops += 1


def tick(*agents: Agent) -> None:
    for agent in agents:
        agent.lease.tick()


def ticked(run_dir: Path, names: str) -> tuple[Clock, list[Agent]]:
    """An agent per letter of `names` on one clock, each ticked once in that order (the first holds)."""
    clock = Clock()
    agents = [Agent(run_dir, name, clock) for name in names]
    tick(*agents)
    return clock, agents


def test_the_first_agent_takes_the_lease_and_the_other_follows_its_renewals(tmp_path: Path) -> None:
    clock, (a, b) = ticked(tmp_path, "ab")
    assert (a.lease.held, b.lease.held, a.served) == (1, 0, [{}])
    assert placement.address(tmp_path) == "http://a:29510"
    assert b.lease.live == "", "a lease not yet seen renewed may be an earlier launch's"
    for _ in range(20):  # 4 s of renewals: never lapsed for b
        clock.now += 0.2
        tick(a, b)
    assert (a.lease.held, b.lease.held, b.lease.live, b.served) == (1, 0, "http://a:29510", [])


def test_a_lapsed_lease_is_taken_by_one_agent_with_the_previous_holders_fields(tmp_path: Path) -> None:
    clock, (a, b, c) = ticked(tmp_path, "abc")
    clock.now += 0.9  # a is lost: its lease stays as it was
    tick(b, c)
    assert not b.served and not c.served, "taken before the lease lapsed"
    clock.now += 0.2
    tick(b, c)
    assert (b.lease.held, c.lease.held) == (2, 0), "two holders of one generation"
    assert b.served[0]["holder"] == "a" and b.served[0]["nproc"] == 2
    assert placement.address(tmp_path) == "http://b:29510"


def test_a_holder_steps_down_when_it_cannot_renew_before_any_reader_may_take_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, (a, b) = ticked(tmp_path, "ab")

    def unreachable(*args: object, **kwargs: object) -> None:  # the run dir's server gone (root: no chmod)
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(placement.rundir, "write_bytes", unreachable)
        for _ in range(3):
            clock.now += 0.2
            a.lease.tick()
    assert (a.lease.held, a.stops) == (0, 1), "a holder that cannot renew kept serving"
    b.lease.tick()
    assert b.lease.held == 0, "the reader took over before the lease lapsed on its own clock"


def test_a_holder_that_sees_a_newer_lease_stops_serving(tmp_path: Path) -> None:
    clock, (a, b) = ticked(tmp_path, "ab")
    clock.now += 1.1  # a was frozen past the lease: b takes it
    b.lease.tick()
    assert b.lease.held == 2
    a.lease.tick()
    assert (a.lease.held, a.stops, a.lease.live) == (0, 1, "")


def test_a_free_lease_is_left_to_node_0_for_the_patience_of_the_others(tmp_path: Path) -> None:
    clock = Clock()
    other = Agent(tmp_path, "n1", clock)
    other.lease.patience_s = 1.0
    other.lease.tick()
    clock.now += 0.5
    other.lease.tick()
    assert other.lease.held == 0, "took the first lease before node 0 could"
    clock.now += 0.6
    other.lease.tick()
    assert other.lease.held == 1, "node 0 absent: the others take it after their patience"


def test_a_released_lease_is_taken_at_once_and_names_no_address(tmp_path: Path) -> None:
    clock = Clock()
    a, b = Agent(tmp_path, "a", clock), Agent(tmp_path, "b", clock)
    a.lease.tick()
    a.lease.release()
    assert placement.address(tmp_path) == ""
    b.lease.tick()
    assert b.lease.held == 2 and b.served[0].get("released") is True


def test_of_agents_racing_for_one_generation_exactly_one_wins(tmp_path: Path) -> None:
    """O_EXCL create decides: 8 agents tick at once on an empty run dir (threads: the kernel decides the
    create either way; the file server does on shared storage)."""
    clock = Clock()
    agents = [Agent(tmp_path, f"n{i}", clock) for i in range(8)]
    barrier = threading.Barrier(len(agents))

    def take(agent: Agent) -> None:
        barrier.wait()
        agent.lease.tick()

    threads = [threading.Thread(target=take, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    held = {a.lease.holder: a.lease.held for a in agents}
    assert sorted(held.values()) == [0] * 7 + [1], held
    (winner,) = [n for n, g in held.items() if g]
    assert json.loads((placement.folder_of(tmp_path) / "lease-000000001.json").read_text())["holder"] == winner


def test_a_member_follows_the_newest_lease_and_reads_no_more_than_once_per_interval(tmp_path: Path) -> None:
    clock = Clock()
    a = Agent(tmp_path, "a", clock)
    follow = placement.Follow(tmp_path, every_s=3600)
    assert follow() == ""  # nothing placed yet
    a.lease.tick()
    assert follow() == "", "read again within its interval"
    assert placement.Follow(tmp_path)() == "http://a:29510"
