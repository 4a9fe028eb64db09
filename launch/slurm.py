"""`python -m launch.slurm`: the command users type; the code is torchlaunch.backends.slurm.launch (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.backends.slurm.launch", run_name="__main__", alter_sys=True)
