"""`python -m launch.lighthouse`: the live group's membership service, run apart from the training nodes
(recovery.lighthouse); the code is torchlaunch.live.lighthouse (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.live.lighthouse", run_name="__main__", alter_sys=True)
