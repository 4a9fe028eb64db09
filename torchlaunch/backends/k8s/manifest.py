"""The objects of one Kubernetes run, as pure dicts in apply order (YAML only at the edge, in launch.py).

One run is five objects: a headless Service (stable DNS names `<name>-<i>.<name>` for the pods), a
NetworkPolicy admitting only the run's own pods, a ConfigMap holding the recipe, a ReadWriteMany PVC for
the run directory (checkpoints, metrics, data), and an Indexed Job with one pod per node. Pod i runs
`launch.local --node-rank i`; pods i > 0 first wait, bounded, until pod 0's rendezvous port accepts TCP
connections (a DNS record alone does not mean torchrun listens yet). Preemption (exit 75) and node
disruptions do not count as failures, bad input (exit 2) fails the Job at once; the replacement pods
resume from the newest checkpoint.

Live recovery (`recovery.live=true` in the recipe or an override): three more objects, the membership
service's NetworkPolicy, ClusterIP Service and Deployment, and a Job that replaces a lost pod for its
index while the others train on; every pod waits for the service instead of pod 0
(torchlaunch.backends.k8s.live says why each).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from torchlaunch import contract, grace
from torchlaunch.backends.k8s import elastic as k8s_elastic
from torchlaunch.backends.k8s import hardening
from torchlaunch.backends.k8s import live as k8s_live
from torchlaunch.backends.k8s.options import K8sOptions, image, run_dir, validate
from torchlaunch.exit_codes import BAD_INPUT, PREEMPTED
from torchlaunch.jobs import record
from torchlaunch.launch import emit
from torchlaunch.launch.spec import JobSpec

Manifest = dict[str, Any]

CONTAINER = "trainer"


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
        service = k8s_live.overrides(opts.name, opts.live) if opts.live is not None else list(opts.pinned)
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
