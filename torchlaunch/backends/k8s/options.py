"""One Kubernetes run's own knobs (K8sOptions, beside the scheduler-independent JobSpec) and the check
that refuses, in one line, every value the API server would reject: run before any manifest is rendered,
so a bad value never reaches stdout or a cluster."""

from __future__ import annotations

from dataclasses import dataclass

from torchlaunch.backends.k8s import elastic as k8s_elastic
from torchlaunch.backends.k8s import live as k8s_live
from torchlaunch.backends.k8s import validate as k8s_validate
from torchlaunch.jobs import ranklog
from torchlaunch.launch import cli, shape
from torchlaunch.launch.spec import JobSpec

DEFAULT_IMAGE = "registry.example.com/torchlaunch:0.1.0"


WAIT_TIMEOUT_MAX_S = shape.OPTIONS["master_wait_s"].high
"""--wait-timeout-s's bound: launch.local's --master-wait-s's, which live pods pass it to."""


@dataclass(frozen=True)
class K8sOptions:
    """Kubernetes-only knobs; everything scheduler-independent is in JobSpec."""

    name: str = "torchlaunch"
    """Prefix of every object; pods are `<name>-<index>`, reachable as `<name>-<index>.<name>`."""
    namespace: str | None = None
    """None: the namespace `kubectl apply -n` (or the context) chooses."""
    storage_class: str | None = None
    """StorageClass of the shared PVC; must support ReadWriteMany (NFS, CephFS, Filestore...). None:
    the cluster default."""
    storage_size: str = "100Gi"
    save_time_s: int = 60
    """Measured worst-case checkpoint save time; sizes the termination grace period."""
    step_time_s: int = 30
    """Worst-case time of one training step: a stop is honoured at the next step boundary."""
    backoff_limit: int | None = None
    """Pod failures (crashes, lost peers) tolerated; None: 3 per node, since one lost node also
    fails its peers' pods. Preemptions (exit 75) and disruptions are not counted."""
    cpu_only: bool = False
    """Run the workers on CPU (gloo) and request no GPUs: for clusters or tests without GPUs."""
    cpus_per_gpu: int = 8
    mem_gb_per_gpu: int = 32
    shm_gb_per_gpu: int = 2
    """Size of the in-memory /dev/shm that DataLoader workers use to pass batches."""
    doctor: bool = False
    """Run the distributed pre-flight (rendezvous, all_reduce, shared PVC, lead time) instead of training."""
    wait_timeout_s: int = 600
    """How long pods i > 0 wait for pod 0's rendezvous port (torchrun's own join timeout is 600 s); in live
    mode how long every pod waits for the membership service and, with a fixed --nodes N, how long a
    first-group pod's launcher waits for pod 0's name to resolve (launch.local --master-wait-s)."""
    config_dir: str = "/config"
    shared_dir: str = "/shared"
    workdir: str | None = None
    """The pods' working directory; None: the shared volume (relative recipe paths land there)."""
    hang_timeout: float | None = None
    """Each pod's hang watchdog (its launcher's --hang-timeout): None automatic, 0 off. A hang ends the
    pod's ranks with exit 1, which the Job retries within its backoff limit."""
    console: ranklog.Console = ranklog.Console()
    """Which ranks' output reaches the pod's log, and whether each line names its rank."""
    jobset: bool = False
    """Render a JobSet around the Job (torchlaunch.backends.k8s.elastic) instead of the Job and its Service."""
    jobset_restarts: int = k8s_elastic.DEFAULT_JOBSET_RESTARTS
    """The JobSet's failurePolicy.maxRestarts: whole-set restarts after the Job failed."""
    reconfigure: bool = False
    """Each pod's launcher takes --reconfigure: the rendered config replaces the run dir's (the first pod
    to start rewrites it; every later start finds the same values, no change)."""
    live: k8s_live.Live | None = None
    """Live recovery (recovery.live auto, the default, or true: backends.k8s.live.from_config): the
    membership service's Deployment and Service, and a Job that replaces a lost pod while the others train
    on (torchlaunch.backends.k8s.live); None: the restart road."""
    pinned: tuple[str, ...] = ()
    """Overrides every pod's launcher gets so that it takes the rendered road (backends.k8s.live.pinned)."""

    @property
    def grace_period_s(self) -> int:
        """Finish the current step, save, exit: with 30 s to spare for process teardown."""
        return self.step_time_s + self.save_time_s + 30

    def backoff(self, nodes: int) -> int:
        if self.doctor:
            return 0  # a pre-flight reports; retrying it would only hide the failure
        return self.backoff_limit if self.backoff_limit is not None else 3 * nodes


def run_dir(spec: JobSpec, opts: K8sOptions) -> str:
    """Normalised and on the shared volume (BadInput otherwise): `..` cannot lead off it."""
    wanted = spec.run_dir or f"{opts.shared_dir}/runs/{opts.name}"
    return k8s_validate.run_dir_under(wanted, opts.shared_dir, "--run-dir", workdir=opts.workdir)


def image(spec: JobSpec) -> str:
    return spec.image or DEFAULT_IMAGE


def validate(spec: JobSpec, opts: K8sOptions) -> None:
    """Refuse (BadInput, one line) every value the API server would reject, before anything is printed."""
    # Pod hostnames are `<name>-<index>` and must stay DNS labels (<= 63 characters).
    k8s_validate.object_name(opts.name, "--name", nodes=spec.nodes)
    if opts.live is not None:
        k8s_live.check(spec, opts.jobset)
    k8s_elastic.check(spec, opts.name, opts.jobset, opts.jobset_restarts, live=opts.live is not None)
    if opts.namespace is not None:
        k8s_validate.dns1123_label(opts.namespace, "--namespace")
    if opts.storage_class is not None:
        k8s_validate.dns1123_subdomain(opts.storage_class, "--storage-class")
    k8s_validate.quantity(opts.storage_size, "--storage-size")
    k8s_validate.port(spec.master_port, "--master-port")
    k8s_validate.image_reference(DEFAULT_IMAGE if spec.image is None else spec.image, "--image")
    for field, value in (
        ("--save-time-s", opts.save_time_s),
        ("--step-time-s", opts.step_time_s),
        ("--wait-timeout-s", opts.wait_timeout_s),
    ):
        if value < 1:
            raise cli.error(f"{field} must be >= 1, got {value}")
    if opts.wait_timeout_s > WAIT_TIMEOUT_MAX_S:
        raise cli.error(f"--wait-timeout-s must be at most {WAIT_TIMEOUT_MAX_S} (a week), got {opts.wait_timeout_s}")
    if opts.backoff_limit is not None and opts.backoff_limit < 0:
        raise cli.error(f"--backoff-limit must be >= 0, got {opts.backoff_limit}")
    if opts.workdir is not None and not opts.workdir.startswith("/"):
        raise cli.error(
            f"--workdir {opts.workdir!r} must be an absolute path in the image (where your code is, e.g. /code)"
        )
    if any(o.startswith("run_dir=") for o in spec.overrides):
        raise cli.error("set the run directory with --run-dir, not a run_dir= override")
    run_dir(spec, opts)  # normalised; relative paths resolve against the pods' working dir
