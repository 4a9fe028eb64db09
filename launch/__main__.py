"""`python -m launch status|logs|cancel|list RUN_DIR`: the command users type; the code is torchlaunch.jobs.cli."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.jobs.cli", "launch")  # torch-free where it can be: a package is asked for only when used
