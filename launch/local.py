"""`python -m launch.local`: the command users type; the code is torchlaunch.launch.local (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.launch.local", run_name="__main__", alter_sys=True)
