"""`python -m launch.slurm`: the command users type; the code is torchlaunch.backends.slurm.launch (nothing imports this)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.backends.slurm.launch", "launch.slurm", deps.SUBMIT)
