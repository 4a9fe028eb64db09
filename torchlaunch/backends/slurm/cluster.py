"""Every run of Slurm's tools (squeue, sacct, scontrol, sinfo, sbatch, scancel) by a launcher, a task or an
operator command: one way to call them (`run`), one function per question, one error rule.

The rule: a command that gives no answer (the tool missing, not startable, or past its timeout) is None,
and a query that does not exit 0 is None too ("cannot say"). Each question turns None into its own
"cannot say" (UNKNOWN, no partitions, no GraceTime), never into "the job is over": a machine without
the Slurm tools must never conclude that a job ended and take over its run dir. Every call is bounded:
a dead controller never hangs a launcher, a task or `launch status`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchlaunch.backends.slurm.states import SLURM_ID
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BadInput

QUERY_TIMEOUT_S = 20.0
"""How long a question may take to answer (a loaded slurmctld answers in well under a second)."""
ACTION_TIMEOUT_S = 60.0
"""How long sbatch, scancel or `scontrol requeue` may take: a requeue refused for a slow answer costs the run."""


@dataclass(frozen=True)
class Answer:
    """What a Slurm command said: its exit code, stdout and stderr."""

    code: int
    out: str
    err: str


def run(argv: Sequence[str], timeout_s: float = QUERY_TIMEOUT_S, env: Mapping[str, str] | None = None) -> Answer | None:
    """The one way a Slurm command is run: output captured, bounded, never raising. None when it gave no
    answer (missing, not startable, or past `timeout_s`)."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=dict(env) if env is not None else None,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return Answer(done.returncode, done.stdout, done.stderr)


def ask(argv: Sequence[str], timeout_s: float = QUERY_TIMEOUT_S) -> str | None:
    """A question's answer: the command's stdout when it exited 0; None (cannot say) otherwise."""
    done = run(argv, timeout_s)
    return done.out if done is not None and done.code == 0 else None


def have(tool: str) -> bool:
    """Whether this machine has the Slurm command `tool` (a login node has; a laptop has not)."""
    return shutil.which(tool) is not None


# ---- a job ------------------------------------------------------------------------------------------


def squeue_state(job_id: str) -> str | None:
    """slurmctld's live state of the job (squeue), None when it cannot say or no longer lists the job."""
    out = ask(["squeue", "-h", "-j", job_id, "-o", "%T"])
    return (out or "").strip() or None


def sacct_state(job_id: str) -> str | None:
    """Accounting's state of the job (sacct: its last record), None when it cannot say or has none."""
    out = ask(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id])
    lines = [line.strip() for line in (out or "").splitlines() if line.strip()]
    return lines[-1] if lines else None


def job_fields(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o`'s KEY=VALUE words (slurmctld's memory of the job, finished ones too for
    MinJobAge), the first of each key; None when it cannot say."""
    out = ask(["scontrol", "show", "job", "-o", job_id])
    if out is None:
        return None
    fields: dict[str, str] = {}
    for word in out.split():
        key, sep, value = word.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def owner_fields(job_id: str, timeout_s: float = QUERY_TIMEOUT_S) -> tuple[str, str] | None:
    """The job's standard output path and comment as squeue prints them (what proves whose job it is:
    backends.slurm.proof); None when squeue cannot say or does not list the job."""
    out = ask(["squeue", "-h", "-j", job_id, "-O", "StdOut:4096,Comment:4096"], timeout_s)
    lines = (out or "").strip().splitlines()
    if not lines:
        return None
    return lines[0][:4096].strip(), lines[0][4096:].strip()


def controller_state(job_id: str) -> str:
    """The job's live state from slurmctld: RUNNING while a timeout or preemption signal is pending,
    COMPLETING once scancel or the hard time limit is ending it."""
    return squeue_state(job_id) or "UNKNOWN"


def job_state(job_id: str) -> str:
    """The job's state from accounting (first word: "CANCELLED by 0" -> "CANCELLED")."""
    return sacct_state(job_id) or "UNKNOWN"


def scontrol_state(job_id: str) -> str:
    """The job's state from `scontrol show job` (slurmctld's memory of finished jobs, MinJobAge), which
    knows a job's end even where accounting has no record of it."""
    return (job_fields(job_id) or {}).get("JobState") or "UNKNOWN"


def state(job_id: str) -> str | None:
    """squeue while the job is known to the controller, else sacct's final state (status, list)."""
    if not SLURM_ID.match(job_id):
        return None
    live = squeue_state(job_id)
    return live.split()[0] if live else sacct_state(job_id)


def set_comment(job_id: str, comment: str, timeout_s: float = QUERY_TIMEOUT_S) -> bool:
    """`scontrol update JobId=... Comment=...`; whether slurmctld took it."""
    done = run(["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"], timeout_s)
    return done is not None and done.code == 0


def requeue(job_id: str) -> Answer | None:
    """`scontrol requeue`: the job's tasks end and it goes back to the queue, its restart count one up."""
    return run(["scontrol", "requeue", job_id], ACTION_TIMEOUT_S)


def scancel(job_id: str) -> bool:
    """`scancel`; whether Slurm took it."""
    done = run(["scancel", job_id], ACTION_TIMEOUT_S)
    return done is not None and done.code == 0


def sbatch(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Submit with `argv` (sbatch --parsable ...) in `env`: the new job's id. RuntimeError, with sbatch's
    last line, when it was refused or gave no answer."""
    done = run(argv, ACTION_TIMEOUT_S, env=env)
    if done is None:
        raise RuntimeError(f"sbatch gave no answer within {ACTION_TIMEOUT_S:.0f} s, or is not installed")
    job = done.out.strip().split(";")[0]
    if done.code != 0 or whole(job, 20) is None:
        raise RuntimeError((done.err.strip().splitlines() or [f"sbatch exited {done.code}"])[-1])
    return job


# ---- the cluster's partitions -----------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gres: str


PARTITION_NAMES = ("sinfo", "-h", "-o", "%P")
"""sinfo's list of partitions, the default one marked `*`."""


def cluster_partitions() -> dict[str, Partition] | None:
    """Partitions from sinfo, or None when no cluster is reachable (then nothing is checked)."""
    out = ask(["sinfo", "-h", "-o", "%R|%D|%G"])
    if out is None:
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
    out = ask(PARTITION_NAMES)
    return next((p.rstrip("*") for p in (out or "").split() if p.endswith("*")), None)


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
    probe = run(PARTITION_NAMES)
    if probe is not None and NO_SLURM_CONF in probe.err:
        raise BadInput(no_slurm_conf_message())


GRACE_TIME = re.compile(r"(?:^|\s)GraceTime=([0-9]+)(?:\s|$)")


def grace_time_of(scontrol_out: str) -> int | None:
    """GraceTime in `scontrol show partition NAME -o`'s line (seconds), when it is there and above 0."""
    found = GRACE_TIME.search(scontrol_out)
    return int(found[1]) if found and 0 < int(found[1]) < 10**7 else None


def partition_grace_s(partition: str | None) -> int | None:
    """The partition's GraceTime, when scontrol answers; None where it cannot be read (then the --signal
    lead time alone is the worker's)."""
    out = ask(["scontrol", "show", "partition", partition, "-o"]) if partition else None
    return grace_time_of(out) if out is not None else None


def node_cpus(partition: str | None) -> int | None:
    """The most CPUs of one node (of `partition`), when sinfo answers; None when no cluster is reachable."""
    out = ask(["sinfo", "-h", "-o", "%c", *(["-p", partition] if partition else [])])
    counts = [int(c) for c in re.findall(r"\d+", out or "")]
    return max(counts) if counts else None
