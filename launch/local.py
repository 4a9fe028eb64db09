"""`python -m launch.local`: the command users type; the code is torchlaunch.agent (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.agent", "launch.local", deps.TRAINING)
