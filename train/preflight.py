"""`python -m train.preflight`: the command users type; the code is torchlaunch.tools.preflight (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.tools.preflight", run_name="__main__", alter_sys=True)
