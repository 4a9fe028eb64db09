"""`python -m train.doctor`: the command users type; the code is torchlaunch.tools.doctor (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.tools.doctor", "train.doctor")
