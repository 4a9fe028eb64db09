"""Kubernetes launcher: JobSpec -> manifests (pure dicts), YAML only at the edge. Never talks to a cluster.

    python -m launch.k8s --nodes 4 --gpus-per-node 8 --image REG/IMG:TAG > job.yaml
    kubectl apply -f job.yaml

One run is five objects: a headless Service (stable DNS names `<name>-<i>.<name>` for the pods), a
NetworkPolicy admitting only the run's own pods, a ConfigMap holding the recipe, a ReadWriteMany PVC for the run directory (checkpoints, metrics, data),
and an Indexed Job with one pod per node. Pod i runs `launch.local --node-rank i`; pods i > 0 first
wait, bounded, until pod 0's rendezvous port accepts TCP connections (a DNS record alone does not mean
torchrun listens yet). Preemption (exit 75) and node disruptions do not count as failures, bad input
(exit 2) fails the Job at once; the replacement pods resume from the newest checkpoint.

Live recovery (`recovery.live=true` in the recipe or an override): three more objects, the membership
service's NetworkPolicy, ClusterIP Service and Deployment, and a Job that replaces a lost pod for its
index while the others train on; every pod waits for the service instead of pod 0
(torchlaunch.backends.k8s.live says why each).

A user's program instead of the built-in worker: `python -m launch.k8s ... -- SCRIPT.py args` (or
`-- -m pkg.mod args`) puts it after `--` in every pod's launch.local command (no recipe ConfigMap
then). Its code comes from the image (a Dockerfile FROM the project image that COPYs it) or a volume;
`--workdir` is the pods' working directory, where a relative SCRIPT.py is found. See docs/KUBERNETES.md.

The same module holds the pods' `--wait-for HOST:PORT` helper, so the image needs nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from torchlaunch import contract, grace
from torchlaunch.backends.k8s import elastic as k8s_elastic
from torchlaunch.backends.k8s import hardening, offline_check
from torchlaunch.backends.k8s import live as k8s_live
from torchlaunch.backends.k8s import validate as k8s_validate
from torchlaunch.base.untrusted import quote, whole
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED
from torchlaunch.jobs import ranklog, record
from torchlaunch.launch import cli, emit, shape
from torchlaunch.launch.spec import DEFAULT_MASTER_PORT, JobSpec

Manifest = dict[str, Any]

CONTAINER = "trainer"
RUN_AS = hardening.RUN_AS
DEFAULT_IMAGE = "registry.example.com/torchlaunch:0.1.0"
DEFAULT_CONFIG = "configs/cifar10.yaml"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


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
    """Live recovery (recovery.live=true in the recipe or an override): the membership service's
    Deployment and Service, and a Job that replaces a lost pod while the others train on
    (torchlaunch.backends.k8s.live); None: off."""

    @property
    def grace_period_s(self) -> int:
        """Finish the current step, save, exit: with 30 s to spare for process teardown."""
        return self.step_time_s + self.save_time_s + 30

    def backoff(self, nodes: int) -> int:
        if self.doctor:
            return 0  # a pre-flight reports; retrying it would only hide the failure
        return self.backoff_limit if self.backoff_limit is not None else 3 * nodes


def labels(opts: K8sOptions) -> dict[str, str]:
    return {"app.kubernetes.io/name": "torchlaunch", "app.kubernetes.io/instance": opts.name}


def metadata(opts: K8sOptions, name: str, *, skips: dict[str, str] | None = None) -> Manifest:
    """Object metadata; `skips` are checkov findings waived here, each with its reason beside it."""
    meta: Manifest = {"name": name, "labels": labels(opts)}
    waived = dict(skips or {})
    if opts.namespace:
        meta["namespace"] = opts.namespace
    else:
        waived["CKV_K8S_21"] = "namespace chosen at apply time (kubectl apply -n NS); --namespace pins one"
    if waived:
        meta["annotations"] = {
            f"checkov.io/skip{i}": f"{check}={reason}"
            for i, (check, reason) in enumerate(sorted(waived.items()), start=1)
        }
    return meta


def master_addr(spec: JobSpec, opts: K8sOptions) -> str:
    """Pod 0's stable name: hostname `<name>-0` in the headless service's subdomain `<name>`; a live
    range's pods name the membership service's host instead (torchlaunch.backends.k8s.live)."""
    pod0 = k8s_elastic.master_addr(opts.name, opts.jobset)
    return pod0 if opts.live is None else k8s_live.master_addr(opts.name, spec, opts.live, pod0)


def claim_name(opts: K8sOptions) -> str:
    """The shared volume's claim: the run dir's home, mounted by every worker and, read-only, by the live
    membership service (for the run's secret)."""
    return f"{opts.name}-shared"


def run_dir(spec: JobSpec, opts: K8sOptions) -> str:
    """Normalised and on the shared volume (BadInput otherwise): `..` cannot lead off it."""
    wanted = spec.run_dir or f"{opts.shared_dir}/runs/{opts.name}"
    return k8s_validate.run_dir_under(wanted, opts.shared_dir, "--run-dir", workdir=opts.workdir)


def recipe_key(spec: JobSpec) -> str:
    return PurePosixPath(spec.config).name


def pod_script(spec: JobSpec, opts: K8sOptions) -> str:
    """The pod's shell program: wait for pod 0 (pods > 0 only), then exec the node agent.

    exec keeps the launcher as tini's direct child, so SIGTERM from the kubelet reaches it, and it
    forwards it to torchrun and the workers (checkpoint, exit 75).
    """
    launcher = [
        "python",
        "-m",
        "torchlaunch.agent",
        *(k8s_elastic.nodes_args(spec) if opts.live is None else k8s_live.nodes_args(spec)),
        "--master-addr",
        '"$MASTER_ADDR"',
        "--master-port",
        '"$MASTER_PORT"',
        *(k8s_live.master_wait_args(spec, opts.wait_timeout_s) if opts.live is not None else []),
        "--gpus",
        str(spec.gpus_per_node),
    ]
    if opts.cpu_only:
        launcher += ["--device", "cpu"]
    if opts.doctor:
        launcher += ["--doctor"]
    if opts.reconfigure:
        launcher += ["--reconfigure"]
    if spec.max_restarts:
        launcher += ["--max-restarts", str(spec.max_restarts)]
    if opts.hang_timeout is not None:
        launcher += ["--hang-timeout", f"{opts.hang_timeout:g}"]
    launcher += opts.console.args()
    if spec.program:
        if opts.doctor:
            launcher += ["--run-dir", emit.shell_word(run_dir(spec, opts), "--run-dir")]  # the shared volume to probe
        launcher += ["--", *(emit.shell_word(a, "program argument") for a in spec.program)]
    else:
        launcher += ["--config", emit.shell_word(f"{opts.config_dir}/{recipe_key(spec)}", "--config")]
        lead = (
            []
            if any(o.startswith("preemption.lead_time_s=") for o in spec.overrides)
            else [f"preemption.lead_time_s={opts.grace_period_s}"]
        )  # the worker warns if a save won't fit
        service = k8s_live.overrides(opts.name, opts.live) if opts.live is not None else []
        launcher += [
            emit.shell_word(o, "override") for o in (*lead, f"run_dir={run_dir(spec, opts)}", *service, *spec.overrides)
        ]
    return "\n".join(["set -eu", *wait_lines(opts), "exec " + " ".join(launcher)]) + "\n"


def wait_command(endpoint: str, opts: K8sOptions) -> str:
    """A bounded wait until `endpoint` (one shell word, HOST:PORT) accepts TCP connections."""
    return f"python -m torchlaunch.backends.k8s.launch --wait-for {endpoint} --wait-timeout-s {opts.wait_timeout_s}"


def wait_lines(opts: K8sOptions) -> list[str]:
    """What a pod waits for before its launcher starts. Pods i > 0 wait for pod 0's rendezvous port (a
    DNS record alone does not mean torchrun listens yet). In live mode every pod waits for the membership
    service instead, none for pod 0: a pod the Job replaced joins through the service, and pod 0 may be
    the one lost (torchlaunch.backends.k8s.live)."""
    if opts.live is not None:
        return [wait_command(emit.shell_word(k8s_live.endpoint(opts.name, opts.live), "recovery.lighthouse"), opts)]
    return [
        'if [ "$JOB_COMPLETION_INDEX" != 0 ]; then',
        "  " + wait_command('"$MASTER_ADDR:$MASTER_PORT"', opts),
        "fi",
    ]


def service(spec: JobSpec, opts: K8sOptions) -> Manifest:
    """Headless: gives each pod the DNS name `<hostname>.<name>`; no load balancing, no virtual IP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(opts, opts.name),
        "spec": {
            "clusterIP": "None",
            # Resolve pod 0 before it is Ready: there is no readiness probe worth waiting for.
            "publishNotReadyAddresses": True,
            "selector": labels(opts),
            "ports": [
                {"name": "rendezvous", "port": spec.master_port, "targetPort": spec.master_port, "protocol": "TCP"}
            ],
        },
    }


def config_map(spec: JobSpec, opts: K8sOptions, recipe_text: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(opts, f"{opts.name}-recipe"),
        "data": {recipe_key(spec): recipe_text},
    }


def shared_claim(opts: K8sOptions) -> Manifest:
    claim: Manifest = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": opts.storage_size}},
    }
    if opts.storage_class:
        claim["storageClassName"] = opts.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(opts, claim_name(opts)),
        "spec": claim,
    }


def resources(spec: JobSpec, opts: K8sOptions) -> Manifest:
    gpus = spec.gpus_per_node
    cpus = (spec.cpus_per_task or opts.cpus_per_gpu) * gpus
    mem_gb = spec.mem_gb or opts.mem_gb_per_gpu * gpus
    amounts: dict[str, Any] = {"cpu": str(cpus), "memory": f"{mem_gb}Gi"}
    if not opts.cpu_only:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


def container(spec: JobSpec, opts: K8sOptions) -> Manifest:
    return {
        "name": CONTAINER,
        "image": image(spec),
        "imagePullPolicy": "Always",
        # tini (PID 1) -> sh -> exec launch.local: signals reach the launcher, zombies are reaped.
        "command": ["/usr/bin/tini", "--", "/bin/sh", "-c"],
        "args": [pod_script(spec, opts)],
        # Relative paths in the recipe (data roots, caches) land on the shared volume; a user's program
        # runs from --workdir when given (where its code is: COPYed into the image or mounted).
        "workingDir": opts.workdir or opts.shared_dir,
        "env": [
            {"name": contract.MASTER_ADDR, "value": master_addr(spec, opts)},
            {"name": contract.MASTER_PORT, "value": str(spec.master_port)},
            {"name": "HOME", "value": "/tmp"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            # the pod's terminationGracePeriodSeconds: launch.local sizes torchrun's stop window from it
            {"name": grace.GRACE_ENV, "value": str(opts.grace_period_s)},
            # `python -m launch status|cancel` find the Job from the record the pods write.
            {
                "name": record.K8S_JOB_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}},
            },
            {"name": record.K8S_NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "ports": [{"name": "rendezvous", "containerPort": spec.master_port, "protocol": "TCP"}],
        "resources": resources(spec, opts),
        "securityContext": hardening.container_security(),
        "volumeMounts": [
            *([] if spec.program else [{"name": "recipe", "mountPath": opts.config_dir, "readOnly": True}]),
            {"name": "shared", "mountPath": opts.shared_dir},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def pod_spec(spec: JobSpec, opts: K8sOptions) -> Manifest:
    pod: Manifest = {
        "subdomain": opts.name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": opts.grace_period_s,
        **hardening.pod_isolation(),
        "securityContext": hardening.pod_security(),
        "containers": [container(spec, opts)],
        "volumes": [
            *([] if spec.program else [{"name": "recipe", "configMap": {"name": f"{opts.name}-recipe"}}]),
            {"name": "shared", "persistentVolumeClaim": {"claimName": claim_name(opts)}},
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": f"{opts.shm_gb_per_gpu * spec.gpus_per_node}Gi"},
            },
            {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}},
        ],
    }
    if not opts.cpu_only:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return pod


def network_policy(opts: K8sOptions) -> Manifest:
    """Only the run's own pods may connect to its pods (rendezvous, gloo/NCCL on dynamic ports); in live
    mode on TCP and UDP only, every port of each (k8s_live.worker_ports).

    Egress stays open: datasets and object stores live outside the namespace, and so may a user's own
    membership service.
    """
    rule: Manifest = {"from": [{"podSelector": {"matchLabels": labels(opts)}}]}
    if opts.live is not None:
        rule["ports"] = k8s_live.worker_ports()
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(opts, opts.name),
        "spec": {
            "podSelector": {"matchLabels": labels(opts)},
            "policyTypes": ["Ingress"],
            "ingress": [rule],
        },
    }


def membership_service(spec: JobSpec, opts: K8sOptions) -> list[Manifest]:
    """Live mode's membership service: its NetworkPolicy, Service and Deployment, in apply order (none
    when live mode is off or the user names a service of their own)."""
    if opts.live is None or not k8s_live.renders_service(opts.live):
        return []
    name = k8s_live.service_name(opts.name)
    return [
        k8s_live.network_policy(metadata(opts, name), opts.name, labels(opts)),
        k8s_live.service(metadata(opts, name), opts.name),
        k8s_live.deployment(
            metadata(opts, name, skips=image_skips(spec)),
            opts.name,
            image(spec),
            opts.live,
            k8s_live.SharedRunDir(claim_name(opts), opts.shared_dir, run_dir(spec, opts)),
        ),
    ]


def image(spec: JobSpec) -> str:
    return spec.image or DEFAULT_IMAGE


def image_skips(spec: JobSpec) -> dict[str, str]:
    """The checkov waiver of an image given by tag (every object that runs the image carries it)."""
    if "@sha256:" in image(spec):
        return {}
    return {"CKV_K8S_43": "`make image` tags images; pass --image REG/IMG@sha256:DIGEST to pin a digest"}


def job(spec: JobSpec, opts: K8sOptions) -> Manifest:
    on_container_exit = {"containerName": CONTAINER, "operator": "In"}
    rendered = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(opts, opts.name, skips=image_skips(spec)),
        "spec": {
            "completionMode": "Indexed",
            "completions": spec.nodes,
            "parallelism": spec.nodes,
            "backoffLimit": opts.backoff(spec.nodes),
            # A replacement starts only once the old pod is gone: never two pods of one index
            # writing the run directory or answering at pod 0's name.
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                "rules": [
                    {"action": "FailJob", "onExitCodes": {**on_container_exit, "values": [BAD_INPUT]}},
                    {"action": "Ignore", "onExitCodes": {**on_container_exit, "values": [PREEMPTED]}},
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]
            },
            "template": {
                "metadata": {"labels": labels(opts)},
                "spec": pod_spec(spec, opts),
            },
        },
    }
    if opts.live is not None:
        return k8s_live.job(rendered, opts.backoff_limit)
    return k8s_elastic.job_spec(spec, rendered)


def manifests(spec: JobSpec, opts: K8sOptions, recipe_text: str) -> list[Manifest]:
    """Every object of one run, in apply order."""
    validate(spec, opts)
    recipe = [] if spec.program else [config_map(spec, opts, recipe_text)]  # a user's program has no recipe
    if opts.jobset:  # the JobSet makes the headless Service itself
        return [
            network_policy(opts),
            *recipe,
            shared_claim(opts),
            k8s_elastic.jobset(job(spec, opts), opts.name, opts.jobset_restarts),
        ]
    return [
        service(spec, opts),
        network_policy(opts),
        *membership_service(spec, opts),  # before the Job: its pods wait for the service
        *recipe,
        shared_claim(opts),
        job(spec, opts),
    ]


def validate(spec: JobSpec, opts: K8sOptions) -> None:
    """Refuse (BadInput, one line) every value the API server would reject, before anything is printed."""
    # Pod hostnames are `<name>-<index>` and must stay DNS labels (<= 63 characters).
    derived = [k8s_live.service_name(opts.name)] if opts.live is not None else []
    k8s_validate.object_name(opts.name, "--name", nodes=spec.nodes, derived=derived)
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


# ---- edge: YAML, files, sockets, argv ---------------------------------------------------------------

HEADER = (
    "Generated by `python -m launch.k8s{args}`; do not edit, re-render.",
    "Before `kubectl apply -f`: set the image (--image) and a ReadWriteMany storage class (--storage-class).",
)
"""Header comment lines; the argv in them is escaped by emit.comment."""


def to_yaml(objects: Sequence[Manifest], header: Sequence[str] = ()) -> str:
    """The manifests as YAML documents; every header line becomes an escaped comment."""
    return emit.to_yaml(objects, header)


def wait_for(endpoint: str, timeout_s: float, *, poll_s: float = 1.0) -> bool:
    """True once HOST:PORT accepts a TCP connection; False when `timeout_s` passes first."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return True
        except OSError:  # DNS not there yet, refused, unreachable: all mean "not yet"
            pass
        if time.monotonic() + poll_s > deadline:
            return False
        time.sleep(poll_s)  # polling a remote port: there is no event to wait on


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.Parser(
        prog="python -m launch.k8s",
        description="Render the Kubernetes manifests (Service, ConfigMap, PVC, "
        "Indexed Job) of a training run to stdout.",
    )
    cli.add_common(
        p,
        config_help=f"recipe YAML of the built-in worker (default {DEFAULT_CONFIG}); "
        "shipped to the pods in a ConfigMap; not with a program after --",
        run_dir_help="run directory on the shared volume (default /shared/runs/NAME)",
    )
    shape.add(
        p,
        "nodes",
        default="2",
        help="pods (one per node), or MIN:MAX: elastic, the pods left go on when one is lost (needs --max-restarts)",
    )
    p.add_argument(
        "--jobset",
        action="store_true",
        help="render a JobSet (jobset.x-k8s.io/v1alpha2, for JobSet/Kueue clusters) instead of the Job and Service",
    )
    p.add_argument(
        "--jobset-max-restarts",
        type=int,
        default=k8s_elastic.DEFAULT_JOBSET_RESTARTS,
        help="with --jobset: whole-set restarts after the Job failed (failurePolicy.maxRestarts)",
    )
    shape.add(p, "gpus_per_node", default=8, help="worker processes (GPUs) per pod")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="training image, REGISTRY/IMAGE:TAG (make image)")
    p.add_argument(
        "--workdir",
        default=None,
        help="the pods' working directory, e.g. /code where the image holds your program (default: the shared volume)",
    )
    p.add_argument("--name", default=K8sOptions.name, help="name of the Job, Service, ConfigMap and PVC")
    p.add_argument("--namespace", default=None, help="namespace of every object (default: kubectl's)")
    p.add_argument("--storage-class", default=None, help="ReadWriteMany StorageClass of the shared PVC")
    p.add_argument("--storage-size", default=K8sOptions.storage_size, help="size of the shared PVC")
    shape.add(p, "master_port", default=DEFAULT_MASTER_PORT, help="rendezvous port of pod 0")
    shape.add(p, "max_restarts", default=0, help="torchrun restarts inside a pod")
    shape.add(p, "cpus_per_gpu", default=K8sOptions.cpus_per_gpu)
    shape.add(p, "mem_gb_per_gpu", default=K8sOptions.mem_gb_per_gpu)
    p.add_argument(
        "--save-time-s",
        type=int,
        default=K8sOptions.save_time_s,
        help="measured checkpoint save time; sizes terminationGracePeriodSeconds",
    )
    p.add_argument(
        "--step-time-s",
        type=int,
        default=K8sOptions.step_time_s,
        help="worst-case time of one step; sizes terminationGracePeriodSeconds",
    )
    p.add_argument("--backoff-limit", type=int, default=None, help="pod failures tolerated (default 3 x nodes)")
    p.add_argument("--cpu-only", action="store_true", help="CPU workers (gloo), no GPU requests")
    p.add_argument(
        "--wait-for",
        metavar="HOST:PORT",
        default=None,
        help="(inside pods) wait until HOST:PORT accepts TCP connections, then exit 0",
    )
    p.add_argument("--wait-timeout-s", type=int, default=K8sOptions.wait_timeout_s)
    p.add_argument(
        "--validate",
        action="store_true",
        help="check the manifests against Kubernetes' schemas offline (kubernetes-validate) before printing them",
    )
    cli.add_reconfigure(p)
    cli.add_operation(
        p,
        hang_help="each pod's hang watchdog: end its ranks (exit 1, retried within --backoff-limit) when none "
        "progressed for S seconds; 0 disables (default: max(10 min, 50 x the median step time))",
    )
    return cli.parse(p, argv)


def plan(args: argparse.Namespace) -> tuple[JobSpec, K8sOptions, str]:
    """Validate everything (the recipe and overrides too) before printing anything: the same
    pre-spawn policy as the other launchers, with or without --doctor / --dry-run (this launcher only
    ever prints)."""
    from torchlaunch import config as config_mod
    from torchlaunch.launch import precheck

    shape.check(args, node_example="2 or --nodes 1:4")
    nodes = args.node_range
    if args.program is None:
        args.config = args.config or DEFAULT_CONFIG
    program = cli.check_program(args, on_disk=False, run_dir_for_builtin=True)  # the code is in the image
    common = {
        "nodes": nodes.max,
        "min_nodes": nodes.min if nodes.elastic else None,
        "gpus_per_node": args.gpus_per_node,
        "run_dir": args.run_dir,
        "master_port": args.master_port,
        "max_restarts": args.max_restarts,
        "image": args.image,
    }
    opts = options_from(args)
    if program is not None:
        if args.reconfigure:
            raise cli.error(
                "--reconfigure changes the built-in worker's RUN_DIR/config.yaml; a program after -- has none"
            )
        spec = JobSpec(program=tuple(program.argv()), **common)
        validate(spec, opts)
        return spec, opts, ""
    try:
        with open(args.config, encoding="utf-8") as f:
            recipe_text = f.read()
    except OSError as e:
        raise cli.error(
            f"cannot read --config {args.config}: {e.strerror} (pass a recipe such as configs/cifar10.yaml)"
        ) from None
    cfg = config_mod.load(args.config, args.overrides)  # the pods would fail the same way: fail here
    precheck.check(cfg, on_cpu=args.cpu_only, local=False, doctor=args.doctor)
    spec = JobSpec(config=args.config, overrides=tuple(args.overrides), **common)
    opts = dataclasses.replace(opts, live=k8s_live.from_config(cfg.recovery, args.doctor))
    validate(spec, opts)
    return spec, opts, recipe_text


def options_from(args: argparse.Namespace) -> K8sOptions:
    return K8sOptions(
        name=args.name,
        namespace=args.namespace,
        storage_class=args.storage_class,
        storage_size=args.storage_size,
        save_time_s=args.save_time_s,
        step_time_s=args.step_time_s,
        backoff_limit=args.backoff_limit,
        cpu_only=args.cpu_only,
        cpus_per_gpu=args.cpus_per_gpu,
        mem_gb_per_gpu=args.mem_gb_per_gpu,
        wait_timeout_s=args.wait_timeout_s,
        doctor=args.doctor,
        workdir=args.workdir,
        hang_timeout=args.hang_timeout,
        console=cli.console_of(args),
        jobset=args.jobset,
        jobset_restarts=args.jobset_max_restarts,
        reconfigure=args.reconfigure,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return cli.main(lambda: render(argv))


def render(argv: list[str]) -> int:
    """Print the manifests of `argv` (or, inside a pod, wait for pod 0); BadInput before any output."""
    args = parse_args(argv)
    if args.wait_for is not None:
        if ":" not in args.wait_for or whole(args.wait_for.rpartition(":")[2], 5) is None:
            raise cli.error(f"--wait-for needs HOST:PORT, got {quote(args.wait_for)}")
        if wait_for(args.wait_for, args.wait_timeout_s):
            return OK
        print(
            f"k8s: {args.wait_for} did not accept connections within {args.wait_timeout_s}s (is pod 0, or in live "
            "mode the membership service, running? kubectl get pods)",
            file=sys.stderr,
        )
        return FAILURE
    spec, opts, recipe_text = plan(args)
    own, program = cli.split_program(argv)
    shown = [a for a in own if a != "--dry-run"] + (["--", *program] if program is not None else [])
    header = [line.format(args=(" " + shlex.join(shown)) if shown else "") for line in HEADER]
    text = to_yaml(manifests(spec, opts, recipe_text), header)
    if args.validate:  # no cluster needed, unlike kubectl's dry run; refused before anything is printed
        print(offline_check.check(text), file=sys.stderr)
    sys.stdout.write(text)
    return OK


if __name__ == "__main__":
    sys.exit(main())
