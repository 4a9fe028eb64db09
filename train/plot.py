"""`python -m train.plot`: the command users type; the code is torchlaunch.tools.plot (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.tools.plot", "train.plot")
