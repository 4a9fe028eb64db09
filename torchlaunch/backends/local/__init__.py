"""The local backend: one node's ranks under torchrun (or the single worker) on this host.

launch: JobSpec -> torchrun argv, the foreground run and its stop relay (`python -m launch.local`);
operate: a job is its launcher process on a host (alive while the pid runs; cancel = SIGTERM to it).
"""
