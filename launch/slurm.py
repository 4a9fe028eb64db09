"""`python -m launch.slurm`: the command users type; the code is torchlaunch.launch.slurm (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.launch.slurm", run_name="__main__", alter_sys=True)
