"""`python -m train.doctor`: the command users type; the code is torchlaunch.tools.doctor (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.tools.doctor", run_name="__main__", alter_sys=True)
