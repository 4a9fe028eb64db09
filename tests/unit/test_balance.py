"""The grid's balance (worker/balance.py) and the plan's uneven counts (core/sampler.py) in one process.
From outside, a rank slowed by SIGSTOP/SIGCONT turns: tests/integration/test_exact_balance.py."""

from __future__ import annotations

import dataclasses

import pytest

from torchlaunch.core.sampler import BatchPlan
from torchlaunch.live.replan import replan
from torchlaunch.worker.balance import GAIN, HISTORY, QUICK_GAIN, WINDOW, Balance, best_counts, step_time


def test_the_best_counts_minimise_the_slowest_ranks_time_and_keep_every_rank_measured() -> None:
    assert best_counts([1.0, 2.0], 16) == (11, 5)  # 11 vs 10 time units; 10/6 would take 12
    assert best_counts([1.0, 1.0], 3) == (2, 1)  # a tie goes to the lower rank: every rank says the same
    assert best_counts([1.0, 1000.0, 1.0], 8) == (4, 1, 3)  # a rank barely moving still keeps one
    for paces in ([1.0, 1.3, 0.7, 2.2], [0.01, 0.02], [5.0, 5.0, 5.0]):
        grid = 12
        counts = best_counts(paces, grid)
        assert sum(counts) == grid and min(counts) >= 1
        every = [c for c in _splits(grid, len(paces))]
        assert step_time(counts, paces) == min(step_time(c, paces) for c in every)


def _splits(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    return [(first, *rest) for first in range(1, total - parts + 2) for rest in _splits(total - first, parts - 1)]


def test_a_slow_rank_is_found_at_its_second_slow_step_and_given_fewer_micro_batches() -> None:
    balance = Balance(grid=16, world=2)
    assert balance.counts == (8, 8)
    moved = [balance.observe([0.010, 0.010]), balance.observe([0.010, 0.020]), balance.observe([0.010, 0.020])]
    assert moved[:2] == [None, None]
    assert moved[2] == (11, 5) == balance.counts


def test_noise_below_the_gain_moves_nothing_and_one_slow_step_moves_nothing() -> None:
    balance = Balance(grid=16, world=2)
    jitter = 1.0 + GAIN / 2
    for k in range(40):
        fast, slow = (0.010, 0.010 * jitter) if k % 2 else (0.010 * jitter, 0.010)
        assert balance.observe([fast, slow]) is None
    for _ in range(HISTORY):
        assert balance.observe([0.010, 0.010]) is None
    assert balance.observe([0.010, 0.050]) is None  # a page fault, a checkpoint's copy
    assert balance.observe([0.010, 0.010]) is None
    assert balance.counts == (8, 8)


def test_a_rank_that_recovers_gets_its_micro_batches_back() -> None:
    balance = Balance(grid=8, world=2)
    for _ in range(WINDOW):
        balance.observe([0.010, 0.030])
    assert balance.counts == (6, 2)
    moved = [balance.observe([0.010, 0.010]) for _ in range(WINDOW)]
    assert moved[-1] == (4, 4) and moved[:-1] == [None] * (WINDOW - 1)


def test_a_step_some_rank_did_not_time_is_not_read_and_a_new_group_starts_even() -> None:
    balance = Balance(grid=8, world=2)
    assert balance.observe([0.010, 0.0]) is None  # a dropped step, a rank with no part
    assert balance.observe([0.010]) is None  # a stale list from another world size
    for _ in range(WINDOW):
        balance.observe([0.010, 0.030])
    assert balance.counts == (6, 2)
    balance.restart(3)
    assert balance.counts == (3, 3, 2)


def test_uneven_counts_cut_the_same_micro_batches_and_samples_in_rank_order() -> None:
    batch, grid = 64, 16
    for counts in [(11, 5), (1, 15), (4, 4, 8), (1, 1, 1, 13)]:
        plans = [BatchPlan(640, batch, 0, r, len(counts), grid=grid, counts=counts) for r in range(len(counts))]
        assert [list(p.grid_range()) for p in plans] == [
            list(range(sum(counts[:r]), sum(counts[: r + 1]))) for r in range(len(counts))
        ]
        assert [s for p in plans for s in range(640)[p.rank_slice()]] == list(range(batch))
        assert all(p.accumulation == max(counts) for p in plans)
        assert [p.per_rank for p in plans] == [c * batch // grid for c in counts]


@pytest.mark.parametrize("counts", [(8, 7), (16, 0), (8, 8, 0), (17,)])
def test_counts_that_do_not_cut_the_grid_over_the_world_are_refused(counts: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="do not cut"):
        BatchPlan(640, 64, 0, 0, 2, grid=16, counts=counts)


def test_a_regroup_goes_back_to_the_even_split() -> None:
    plan = BatchPlan(640, 64, 0, 1, 2, grid=16, counts=(11, 5))
    after = replan(plan, 0, 3)
    assert after.counts == () and list(after.grid_range()) == list(range(6))
    assert dataclasses.replace(after, counts=()) == after


def test_a_small_gain_waits_for_the_steadier_median_and_a_large_one_does_not() -> None:
    balance = Balance(grid=16, world=2)
    mild = [0.010, 0.013]  # 8/8 takes 10.4 units, 9/7 9.1: a 12.5% gain, between GAIN and QUICK_GAIN
    assert GAIN < 1 - step_time((9, 7), mild) / step_time((8, 8), mild) < QUICK_GAIN
    moved = [balance.observe(mild) for _ in range(HISTORY)]
    assert moved[:-1] == [None] * (HISTORY - 1) and moved[-1] == (9, 7)
    for _ in range(WINDOW - 1):
        assert balance.observe([0.010, 0.030]) is None
    assert balance.observe([0.010, 0.030]) == (12, 4)  # 9/7 takes 21 units, 12/4 12: found at once
