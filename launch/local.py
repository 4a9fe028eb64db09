"""`python -m launch.local`: the command users type; the code is torchlaunch.backends.local.launch (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.backends.local.launch", run_name="__main__", alter_sys=True)
