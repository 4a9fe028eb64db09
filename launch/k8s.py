"""`python -m launch.k8s`: the command users type; the code is torchlaunch.launch.k8s (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.launch.k8s", run_name="__main__", alter_sys=True)
