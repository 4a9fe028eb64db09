"""`python -m train.shards`: the command users type; the code is torchlaunch.data.shards.cli (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.data.shards.cli", "train.shards", deps.TRAINING)
