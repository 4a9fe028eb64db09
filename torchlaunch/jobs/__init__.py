"""Operating a running job from its run dir: the job record, per-rank heartbeats, the run's state,
the hang watchdog and the `python -m launch status|logs|cancel|list` commands (torch-free)."""
