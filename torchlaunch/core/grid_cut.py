"""How many micro-batches train.exact cuts each global step into (worker/grid.py), without torch: the
launchers refuse a cut that does not divide the batch before any worker starts (launch/precheck.py)."""

from __future__ import annotations

from typing import Protocol

from torchlaunch.exit_codes import ConfigError


class TrainKeys(Protocol):
    """The train.* keys the cut reads (torchlaunch.trainer_sections.TrainConfig: core names no section of the trainer)."""

    exact: bool
    batch_size: int
    grid_micro_batches: int


AUTO_GRID = 8
"""The default number of micro-batches per step: the smallest divisor of the global batch at least this
(so up to 8 ranks, or more with train.grid_micro_batches); fixed by the batch alone, so every world size
of a run, and every resume, cuts the steps the same way."""


def grid_size(train: TrainKeys) -> int:
    """G for this run (0 when train.exact is off): train.grid_micro_batches, else the smallest divisor of
    the global batch >= AUTO_GRID (the batch itself when smaller). Not from train.micro_batch_size: that
    key may change at a resume (config.OPERATIONAL), G may not."""
    if not train.exact:
        return 0
    batch = train.batch_size
    if train.grid_micro_batches:
        return train.grid_micro_batches
    return next(g for g in range(min(AUTO_GRID, batch), batch + 1) if batch % g == 0)


def check_grid(train: TrainKeys) -> None:
    """ConfigError (exit 2, one line) when train.exact's cut does not divide train.batch_size."""
    grid = grid_size(train)
    if grid and train.batch_size % grid:
        raise ConfigError(
            "train.grid_micro_batches",
            f"{grid} micro-batches do not divide train.batch_size={train.batch_size}",
            "use a divisor of the batch at least the largest world size, or 0 for auto",
        )
