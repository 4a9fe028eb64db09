"""`python -m launch.k8s`: the command users type; the code is torchlaunch.backends.k8s.launch (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.backends.k8s.launch", run_name="__main__", alter_sys=True)
