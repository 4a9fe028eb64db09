"""`python -m launch.k8s`: the command users type; the code is torchlaunch.backends.k8s.launch (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.backends.k8s.launch", "launch.k8s", deps.RENDER)
