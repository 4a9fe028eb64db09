"""The Slurm backend's questions to the cluster: every run of Slurm's tools (squeue, sacct, scontrol,
sinfo) that a launcher, a task or an operator command makes.

Every query is bounded by a timeout and answers "cannot say" (None, UNKNOWN) when the tool is missing
or fails: a machine without the Slurm tools must never conclude that a job is over and take over its
run dir.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from torchlaunch.backends.slurm.states import SLURM_ID
from torchlaunch.base.procs import tool_output
from torchlaunch.exit_codes import BadInput


def have(tool: str) -> bool:
    """Whether this machine has the Slurm command `tool` (a login node has; a laptop has not)."""
    return shutil.which(tool) is not None


def controller_state(job_id: str) -> str:
    """The job's live state from slurmctld: RUNNING while a timeout or preemption signal is pending,
    COMPLETING once scancel or the hard time limit is ending it."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    return out.strip() or "UNKNOWN"


def job_state(job_id: str) -> str:
    """The job's state from accounting (first word: "CANCELLED by 0" -> "CANCELLED")."""
    try:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else "UNKNOWN"


def scontrol_state(job_id: str) -> str:
    """The job's state from `scontrol show job` (slurmctld's memory of finished jobs, MinJobAge), which
    knows a job's end even where accounting has no record of it."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "UNKNOWN"
    for word in out.split():
        if word.startswith("JobState="):
            return word.partition("=")[2] or "UNKNOWN"
    return "UNKNOWN"


def state(job_id: str) -> str | None:
    """squeue while the job is known to the controller, else sacct's final state (status, list)."""
    if not SLURM_ID.match(job_id):
        return None
    out = tool_output(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if out and out.strip():
        return out.split()[0]
    out = tool_output(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    lines = [ln.strip() for ln in (out or "").splitlines() if ln.strip()]
    return lines[-1] if lines else None


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gres: str


def cluster_partitions() -> dict[str, Partition] | None:
    """Partitions from sinfo, or None when no cluster is reachable (then nothing is checked)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%R|%D|%G"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    partitions: dict[str, Partition] = {}
    for line in out.splitlines():
        name, nodes, gres = line.split("|")
        known = partitions.get(name)
        count = int(nodes) + (known.nodes if known else 0)
        gres_all = ",".join(g for g in ((known.gres if known else ""), gres) if g and g != "(null)")
        partitions[name] = Partition(name, count, gres_all)
    return partitions


def default_partition() -> str | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return next((p.rstrip("*") for p in out.split() if p.endswith("*")), None)


NO_SLURM_CONF = "Could not establish a configuration source"
"""sbatch's words when neither SLURM_CONF nor the default slurm.conf nor a configless server is found."""


def no_slurm_conf_message() -> str:
    return (
        f"sbatch cannot find the cluster's slurm.conf (sbatch: fatal: {NO_SLURM_CONF}): for the local "
        f'test cluster run `eval "$(slurm/dev-cluster.sh env)"` in this shell first, otherwise '
        f"export SLURM_CONF=<your cluster's slurm.conf>"
    )


def check_slurm_conf() -> None:
    """BadInput before sbatch prints four lines of its own: sinfo finds its config exactly as sbatch does."""
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20)
    except (subprocess.SubprocessError, OSError):
        return
    if NO_SLURM_CONF in probe.stderr:
        raise BadInput(no_slurm_conf_message())


GRACE_TIME = re.compile(r"(?:^|\s)GraceTime=([0-9]+)(?:\s|$)")


def grace_time_of(scontrol_out: str) -> int | None:
    """GraceTime in `scontrol show partition NAME -o`'s line (seconds), when it is there and above 0."""
    found = GRACE_TIME.search(scontrol_out)
    return int(found[1]) if found and 0 < int(found[1]) < 10**7 else None


def partition_grace_s(partition: str | None, timeout_s: float = 10.0) -> int | None:
    """The partition's GraceTime, when scontrol answers; None where it cannot be read (then the --signal
    lead time alone is the worker's)."""
    if not partition or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "partition", partition, "-o"], capture_output=True, text=True, timeout=timeout_s
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return grace_time_of(out)


def node_cpus(partition: str | None, timeout_s: float = 10.0) -> int | None:
    """The most CPUs of one node (of `partition`), when sinfo answers; None when no cluster is reachable."""
    if shutil.which("sinfo") is None:
        return None
    argv = ["sinfo", "-h", "-o", "%c", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    counts = [int(c) for c in re.findall(r"\d+", out)]
    return max(counts) if counts else None
