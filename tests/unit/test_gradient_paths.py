"""test_gradient_paths: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_gradient_paths_shm.py.
"""

from __future__ import annotations

import pytest
from torch import nn

from torchlaunch.core.affinity import core_slice
from torchlaunch.core.shm_reduce import slot_bytes


@pytest.mark.parametrize(
    "available, rank, world, expected",
    [
        ([0, 1], 0, 2, [0]),
        ([0, 1], 1, 2, [1]),
        ([3, 1, 2, 0], 1, 2, [2, 3]),  # sorted, contiguous halves
        ([0, 1, 2, 3, 4], 1, 2, [2, 3, 4]),  # the remainder goes to the last rank
        ([0, 1, 2, 3, 4], 0, 2, [0, 1]),
        ([0, 1, 2, 3], 0, 1, None),  # one rank: leave the mask alone
        ([0], 0, 2, None),  # fewer cores than ranks: leave it alone
        ([0, 1], 2, 2, None),  # a rank outside the node
    ],
)
def test_core_slice(available: list[int], rank: int, world: int, expected: list[int] | None) -> None:
    assert core_slice(available, rank, world) == expected


def test_slot_bytes_fit_the_largest_bucket_and_stay_aligned() -> None:
    small = nn.Linear(10, 3)  # 33 floats = 132 bytes: all parameters together, rounded up to 64
    assert slot_bytes(small) == 192
    big = nn.Linear(4000, 2000)  # a 32 MB weight and a bias: everything fits below cap + largest parameter
    assert slot_bytes(big) == -(-(4000 * 2000 + 2000) * 4 // 64) * 64
    many = nn.Sequential(*[nn.Linear(1000, 1000, bias=False) for _ in range(40)])  # 40 x 4 MB
    assert slot_bytes(many) == 25 * 1024 * 1024 + 4_000_000  # a bucket closes after passing the 25 MB cap
    frozen = nn.Linear(10, 3).requires_grad_(False)
    assert slot_bytes(frozen) == 0
