"""`python -m train.preflight`: the command users type; the code is torchlaunch.tools.preflight (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.tools.preflight", "train.preflight", deps.TRAINING)
