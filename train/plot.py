"""`python -m train.plot`: the command users type; the code is torchlaunch.tools.plot (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.tools.plot", run_name="__main__", alter_sys=True)
