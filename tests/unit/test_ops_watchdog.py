"""test_ops_watchdog: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_ops_watchdog_dumps.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchlaunch.jobs import progress, watchdog
from torchlaunch.jobs.watchdog import Seen


def test_decide_is_armed_by_a_step_and_disabled_by_zero() -> None:
    fresh = [Seen(0, 100.0, None)]
    assert not watchdog.decide(fresh, 10_000.0, 60).hung  # never reported a step: not judged
    old = [Seen(0, 100.0, 5), Seen(1, 90.0, 4)]
    verdict = watchdog.decide(old, 161.0, 60)
    assert verdict.hung and verdict.stalled == (1, 0) and verdict.idle_s == pytest.approx(61)
    assert not watchdog.decide(old, 159.0, 60).hung
    assert not watchdog.decide([Seen(0, 100.0, 5), Seen(1, 150.0, 6)], 161.0, 60).hung  # one rank progressed
    assert not watchdog.decide(old, 1e9, None).hung


def test_default_timeout() -> None:
    assert watchdog.default_timeout([]) == 600
    assert watchdog.default_timeout([0.5, None, 1.0]) == 600
    assert watchdog.default_timeout([30.0, 20.0, 40.0]) == 1500
    assert watchdog.resolve_timeout(0, [1.0]) is None
    assert watchdog.resolve_timeout(5, [100.0]) == 5
    assert watchdog.resolve_timeout(None, [100.0]) == 5000


def test_observe_counts_a_new_beat_as_progress(tmp_path: Path) -> None:
    clock = {"t": 0.0}
    where = progress.folder(tmp_path)
    beat = progress.Heartbeat(where, 0, launch_id="L1", interval_s=0.0, clock=lambda: clock["t"])
    other = progress.Heartbeat(where, 1, launch_id="OLD", interval_s=0.0)
    other.beat(1)
    dog = watchdog.Watchdog(tmp_path, "L1", option_s=30, clock=lambda: clock["t"])
    beat.beat(1)
    assert [s.rank for s in dog.observe()[0]] == [0]  # another launch's heartbeat is not this node's
    clock["t"] = 20.0
    beat.beat(2)
    assert not dog.check().hung  # seen to progress at t=20 (the watchdog's own clock, not the file's)
    clock["t"] = 45.0
    assert not dog.check().hung
    clock["t"] = 51.0
    verdict = dog.check()
    assert verdict.hung and verdict.stalled == (0,)


def test_heartbeat_writes_at_most_every_interval(tmp_path: Path) -> None:
    clock = {"t": 0.0}
    hb = progress.Heartbeat(tmp_path, 0, interval_s=5.0, clock=lambda: clock["t"])
    for step in range(60):
        clock["t"] = step / 8  # exact in binary: no rounding at the interval's edge
        hb.beat(step, samples_per_step=32)
    beats, problems = progress.read_all(tmp_path)
    assert problems == [] and beats[0].beat == 2  # at t=0 and t=5.0: two writes for 60 steps
    assert beats[0].step == 40 and beats[0].step_time == pytest.approx(0.125)
    assert beats[0].images_per_s == pytest.approx(256.0)


def test_heartbeat_is_a_no_op_outside_a_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(progress.PROGRESS_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    progress.heartbeat(1)
    assert progress.register_stack_dump() is None and list(tmp_path.iterdir()) == []


def test_a_gone_or_recycled_pid_is_not_signalled(tmp_path: Path) -> None:
    forged = progress.RankBeat.from_json(
        {"rank": 0, "pid": os.getpid(), "pid_start": 1, "dump_signal": 9, "stack_file": "rank-0.stack"}
    )
    assert forged is not None
    assert watchdog.dump_rank(forged, tmp_path).how == "gone"  # start time does not match: not that process
    odd = progress.RankBeat.from_json({"rank": 0, "stack_file": "../../etc/passwd"})
    assert odd is not None and odd.stack_file is None
