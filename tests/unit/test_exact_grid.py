"""The exact grid's parts in one process: the plan's micro-batch cut (core/sampler.py), the fixed-point
mean (core/fixed_point.py) and one rank's grid step (worker/grid.py). Across ranks and launches:
tests/integration/test_exact.py."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from torchlaunch.config import RunConfig
from torchlaunch.core import fixed_point
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.exit_codes import ConfigError
from torchlaunch.worker.grid import GridStep, grid_size


def test_every_world_size_cuts_the_step_into_the_same_micro_batches() -> None:
    batch, grid = 48, 8
    for world in range(1, grid + 1):
        plans = [BatchPlan(480, batch, 0, r, world, grid=grid) for r in range(world)]
        ids = [i for p in plans for i in p.grid_range()]
        assert ids == list(range(grid))  # each micro-batch once, in rank order
        samples = [s for p in plans for s in range(480)[p.rank_slice()]]
        assert samples == list(range(batch))
        for p in plans:
            assert p.micro_sizes() == [batch // grid] * len(p.grid_range())
            assert p.rank_slice().start == p.grid_range().start * (batch // grid)
        assert max(len(p.grid_range()) for p in plans) - min(len(p.grid_range()) for p in plans) <= 1


@pytest.mark.parametrize("batch, grid, world", [(48, 7, 1), (48, 8, 9)])
def test_a_grid_that_does_not_cut_the_batch_over_the_world_is_refused(batch: int, grid: int, world: int) -> None:
    with pytest.raises(ConfigError, match="train.grid_micro_batches"):
        BatchPlan(480, batch, 0, 0, world, grid=grid)


def test_the_default_grid_is_fixed_by_the_batch_alone() -> None:
    def size(batch: int, grid: int = 0, micro: int = 0) -> int:
        cfg = RunConfig()
        cfg.train.exact, cfg.train.batch_size, cfg.train.grid_micro_batches = True, batch, grid
        cfg.train.micro_batch_size = micro
        return grid_size(cfg.train)

    assert [size(128), size(48), size(50), size(4), size(128, micro=32)] == [8, 8, 10, 4, 8]
    assert size(128, grid=16) == 16
    off = RunConfig()
    assert grid_size(off.train) == 0


def parts(count: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(5, 3, generator=g) * 10.0 ** (i % 7 - 3), torch.randn(4, generator=g)] for i in range(count)]


def mean(ps: list[list[torch.Tensor]], total: int) -> list[torch.Tensor]:
    like = ps[0]
    maxima = fixed_point.local_max(ps, len(like), torch.device("cpu"))
    return fixed_point.exact_mean(ps, like, maxima, total, fixed_point.LocalSum(False))


@pytest.mark.parametrize("total", [8, 6])  # 6: the division by G is not folded into the scale
def test_the_fixed_point_mean_has_the_same_bits_in_any_order_and_is_float32_close(total: int) -> None:
    ps = parts(total)
    want = mean(ps, total)
    got = mean(list(reversed(ps)), total)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    naive = [sum(p[k].double() for p in ps) / total for k in range(2)]
    for a, b in zip(want, naive, strict=True):
        assert torch.allclose(a.double(), b, rtol=1e-6, atol=1e-12)
    # a float32 sum in another order does differ in its bits: what the grid is for
    fwd, back = sum(p[0] for p in ps), sum(p[0] for p in reversed(ps))
    assert not torch.equal(fwd, back)


def test_tiny_values_take_the_float64_scale_and_keep_their_bits_in_any_order() -> None:
    ps = [[p[0] * 1e-30, p[1]] for p in parts(8)]  # a scale past float32's range for the first tensor
    want, got = mean(ps, 8), mean(list(reversed(ps)), 8)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    naive = sum(p[0].double() for p in ps) / 8
    assert torch.allclose(want[0].double(), naive, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_value_makes_its_tensor_nan_and_only_it(bad: float) -> None:
    ps = parts(4)
    ps[2][0][1, 1] = bad
    assert fixed_point.local_max(ps, 2, torch.device("cpu"))[0] == math.inf
    out = mean(ps, 4)
    assert out[0].isnan().all()
    assert out[1].isfinite().all()


def test_the_maxima_are_the_largest_magnitudes_and_a_rank_without_parts_adds_zero() -> None:
    ps = parts(3)
    want = torch.stack([max(p[k].abs().max() for p in ps) for k in range(2)])
    assert torch.equal(fixed_point.local_max(ps, 2, torch.device("cpu")), want)
    assert torch.equal(fixed_point.local_max([], 2, torch.device("cpu")), torch.zeros(2))
    sums = fixed_point.LocalSum(False)
    sums.target(19, torch.device("cpu")).fill_(7.0)  # what an earlier step left in the kept buffer
    out = fixed_point.exact_mean([], ps[0], want, 3, sums)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in out)


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def one_step(order: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One grid step of 4 micro-batches computed in `order` (each with its own id): grads and buffers."""
    torch.manual_seed(0)
    net = BatchNormNet()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)]
    parts: list[list[torch.Tensor]] = []
    for i in order:  # as 4 ranks of one micro-batch each would, their parts then summed together
        torch.manual_seed(0)
        rank = GridStep(BatchNormNet(), 4, seed=3, distributed=False)
        rank.run([batches[i]], i, 1, nn.functional.cross_entropy, lambda t: t, contextlib.nullcontext)
        parts.extend(rank._parts)
    step = GridStep(net, 4, seed=3, distributed=False)
    step.run(batches[:1], 0, 1, nn.functional.cross_entropy, lambda t: t, contextlib.nullcontext)
    step._parts = parts
    step.agree()
    step.finish()
    return [p.grad.clone() for p in net.parameters()], [b.clone() for b in net.buffers()]


def test_a_grid_step_does_not_depend_on_which_micro_batch_ran_first() -> None:
    grads, buffers = one_step([0, 1, 2, 3])
    grads2, buffers2 = one_step([3, 1, 0, 2])
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, buffers2, strict=True))
    assert int(buffers[-1]) == 1  # num_batches_tracked: once per step
    torch.manual_seed(0)
    fresh = BatchNormNet()
    assert not torch.equal(buffers[0], fresh.body[1].running_mean)  # the step moved the running mean


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e20])
def test_float32_parts_rounded_in_float32_give_the_float64_paths_integers(scale: float) -> None:
    """fixed_point.ROUNDING: float32 parts are scaled and rounded in float32 (consumed in place or not);
    the same parts widened to float64 first (the float64 path) give the same bits. Halves at the
    rounding point included (ties go to even in both)."""
    ps = [[p[0] * scale, p[1]] for p in parts(6, seed=3)]
    ps[0][1][0] = 0.5 * 2.0**-48  # an exact tie once scaled: a value of 2**-49 at a max near 1
    wide = [[t.double() for t in p] for p in ps]
    like = ps[0]
    maxima = fixed_point.local_max(ps, 2, torch.device("cpu"))
    want = fixed_point.exact_mean(wide, like, maxima, 6, fixed_point.LocalSum(False))
    kept = fixed_point.exact_mean(ps, like, maxima, 6, fixed_point.LocalSum(False))
    consumed = fixed_point.exact_mean(
        [[t.clone() for t in p] for p in ps], like, maxima, 6, fixed_point.LocalSum(False), consume=True
    )
    for a, b, c in zip(want, kept, consumed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
