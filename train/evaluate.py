"""`python -m train.evaluate`: the command users type; the code is torchlaunch.worker.evaluate (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.worker.evaluate", "train.evaluate", deps.TRAINING)
