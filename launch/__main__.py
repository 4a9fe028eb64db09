"""`python -m launch status|logs|cancel|list RUN_DIR`: the command users type; the code is torchlaunch.jobs.cli."""

import runpy

runpy.run_module("torchlaunch.jobs.cli", run_name="__main__", alter_sys=True)
