"""JobSpec: what to run, independent of where it runs.

Every launcher is a pure function from a JobSpec to its scheduler's artefact (torchrun argv, sbatch
script, Kubernetes manifest), so this module stays free of torch and of any scheduler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class JobSpec:
    """One training job: how many machines and workers, which program or config, and scheduler knobs."""

    config: str = ""
    """Path of the recipe YAML (or a resolved RUN_DIR/config.yaml); empty with a user program."""
    program: tuple[str, ...] = ()
    """A user's program, `SCRIPT.py args` or `-m package.module args` (what follows `--` on every
    launcher); empty: the built-in worker, `-m torchlaunch.worker --config ...` through the runner."""
    overrides: tuple[str, ...] = ()
    """`key.sub=value` overrides applied on top of the YAML."""
    nodes: int = 1
    """Machines (Slurm nodes, Kubernetes pods); with min_nodes, the most the job grows to."""
    min_nodes: int | None = None
    """Elastic jobs (torchlaunch.launch.elastic): the fewest machines the job keeps running on; None:
    exactly `nodes`."""
    gpus_per_node: int = 1
    """Worker processes per machine: one per GPU, or CPU processes on gloo without GPUs."""
    run_dir: str | None = None
    """Where checkpoints, metrics and the resolved config live; shared storage on clusters."""
    master_port: int = DEFAULT_MASTER_PORT
    """Rendezvous port on node 0."""
    max_restarts: int = 0
    """torchrun restarts of the whole worker group after a worker fails."""
    time_min: int = 60
    """Wall-clock limit of one allocation (Slurm --time), minutes."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    signal_delay_s: int = 90
    """Seconds between the scheduler's warning signal and the hard kill."""
    image: str | None = None
    """Container image (Kubernetes; pyxis on Slurm)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Scheduler-specific extras (e.g. additional sbatch parameters)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ValueError(f"min_nodes must be in 1..nodes ({self.nodes}), got {self.min_nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def replace(self, **changes: object) -> JobSpec:
        return dataclasses.replace(self, **changes)
