"""The local backend: one node's ranks under the node agent (torchlaunch.agent) on this host.

launch: the registry's render and submit, both the agent's (`python -m launch.local`);
operate: a job is its launcher process on a host (alive while the pid runs; cancel = SIGTERM to it).
"""
