"""`python -m torchlaunch.agent`: the node agent's command (what a Kubernetes pod runs; users type
`python -m launch.local`, which runs the same)."""

import sys

from torchlaunch.agent.node import main

sys.exit(main())
