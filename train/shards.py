"""`python -m train.shards`: the command users type; the code is torchlaunch.data.shards.cli (nothing imports this)."""

import runpy

runpy.run_module("torchlaunch.data.shards.cli", run_name="__main__", alter_sys=True)
