"""`python -m train.evaluate`: the command users type; the code is torchlaunch.worker.evaluate (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.worker.evaluate", run_name="__main__", alter_sys=True)
