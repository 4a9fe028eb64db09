"""`python -m launch.lighthouse`: the live group's membership service, run apart from the training nodes
(recovery.lighthouse); the code is the live road's service, torchlaunch.live.lighthouse, found through the
road registry (torchlaunch.roads; nothing imports this)."""

import runpy

from torchlaunch import roads

runpy.run_module(roads.get("live").service, run_name="__main__", alter_sys=True)
