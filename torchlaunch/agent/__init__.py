"""The node agent: the one process per node that starts its ranks, relays stops to them, watches
them and reports their outcome. `python -m launch.local` runs it on this host and every Kubernetes
pod runs it (`python -m torchlaunch.agent`): it is named after what it does, not after a backend.

    node.py         the order of one launch: plan, take the run dir, settle the config, run
    options.py      its command line and every check before anything starts (the plan)
    commands.py     what the node runs, pure: torchrun's, the single worker's, the live agent's
    ranks.py        start the ranks (environment, child process) and wait for them
    stops.py        stop signals on their way to the ranks: one relay, the grace
    watch.py        the end of a hung node: torchrun's agent stuck after the watchdog
    outcome.py      the one exit code and its one line
    live_start.py   live mode before the ranks start: a lost node's replacement, a first seat
    live.py         the live agent (recovery.live): ranks regroup in place; the service
    live_rejoin.py  the live agent's rules for a rank that ended before the others
    first_group.py  --nnodes MIN:MAX in live mode: the first group, met in the run dir
    placed.py, live_shared.py, lighthouse_reach.py: live parts a Slurm task shares

Floors: the backends (local, slurm) import this package; it imports none of them.
"""
