"""`python -m launch.local`: the command users type; the code is torchlaunch.backends.local.launch (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.backends.local.launch", "launch.local", deps.TRAINING)
