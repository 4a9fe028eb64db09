"""Kubernetes renderings of an elastic job (`--nodes MIN:MAX`) and of a JobSet (`--jobset`): pure dicts.

Elastic Indexed Job. Every pod runs `launch.local --nnodes MIN:MAX` (torchrun's c10d rendezvous, no node
rank: the rendezvous assigns it per round, torchlaunch.launch.elastic), the store on pod 0 through the
headless Service. parallelism = completions = MAX. A pod whose node is lost is replaced by the Job (its
disruption is not counted as a failure); meanwhile the other pods' agents re-form the group on the pods
left (>= MIN) and resume from the last committed checkpoint; the replacement joins at the next restart
point, after the running ranks commit a checkpoint. Since Kubernetes 1.31 (ElasticIndexedJob, GA) the
Job can also be scaled by changing parallelism and completions together (docs/KUBERNETES.md). The Job
succeeds when pod 0 does (successPolicy, Kubernetes >= 1.33 GA): pod 0's launcher ends 0 only when the
training finished, and a replacement pod still pending then (no node for it) must not keep the Job open.

JobSet (jobset.x-k8s.io/v1alpha2, for clusters running the JobSet controller, e.g. with Kueue). The same
Job is its one replicated job `node`; the JobSet creates the headless Service (network.subdomain = the
run's name, DNS names published before the pods are ready), so none is rendered here. Its failurePolicy
restarts the whole set (every pod, from the last checkpoint) up to maxRestarts times when the Job fails,
and fails it at once when the Job failed on bad input (exit 2: the Job's podFailurePolicy FailJob, reason
PodFailurePolicy).

Losing pod 0 loses the rendezvous store: the other pods' agents cannot re-form the group, their pods fail
and are replaced with pod 0 (a full restart from the last checkpoint, not a degraded one).
"""

from __future__ import annotations

import copy
from typing import Any

from torchlaunch.launch import cli, shape
from torchlaunch.launch.spec import JobSpec

Manifest = dict[str, Any]

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "node"
"""The JobSet's one replicated job: pods are `<name>-node-0-<index>.<name>`."""
DEFAULT_JOBSET_RESTARTS = 3


def nodes_args(spec: JobSpec) -> list[str]:
    """launch.local's node options in a pod: a fixed count with the pod's index, or the elastic range."""
    if spec.min_nodes is None:
        return ["--nnodes", str(spec.nodes), "--node-rank", '"$JOB_COMPLETION_INDEX"']
    return ["--nnodes", shape.NodeRange(spec.min_nodes, spec.nodes).torchrun()]


def check(spec: JobSpec, name: str, jobset: bool, jobset_restarts: int, live: bool = False) -> None:
    """What only an elastic job or a JobSet needs, in one line each. A live range restarts nothing (the
    group shrinks in place: torchlaunch.backends.k8s.live), so it needs no --max-restarts."""
    if spec.min_nodes is not None and spec.max_restarts == 0 and not live:
        nodes = shape.NodeRange(spec.min_nodes, spec.nodes).torchrun()
        raise cli.error(
            f"--nodes {nodes} with --max-restarts 0: a lost pod costs the others one torchrun restart, so the "
            "job would end with it; pass --max-restarts K (e.g. 3)"
        )
    if jobset:
        host = f"{pod_prefix(name, True)}{spec.nodes - 1}"
        if len(host) > 63:
            raise cli.error(f"--name {name!r} is too long for --jobset: pod hostname '{host}' must fit 63 characters")
        if not 0 <= jobset_restarts <= 1000:
            raise cli.error(f"--jobset-max-restarts must be in 0..1000, got {jobset_restarts}")


def pod_prefix(name: str, jobset: bool) -> str:
    """Pod hostnames are this prefix plus the pod's index."""
    return f"{name}-{REPLICATED_JOB}-0-" if jobset else f"{name}-"


def master_addr(name: str, jobset: bool) -> str:
    """Pod 0's stable DNS name in the run's headless Service (ours, or the JobSet's)."""
    return f"{pod_prefix(name, jobset)}0.{name}"


def job_spec(spec: JobSpec, job: Manifest) -> Manifest:
    """The Indexed Job's spec of an elastic job: done when pod 0 succeeds (see the module docstring)."""
    if spec.min_nodes is None:
        return job
    out = copy.deepcopy(job)
    out["spec"]["successPolicy"] = {"rules": [{"succeededIndexes": "0"}]}
    return out


def jobset(job: Manifest, name: str, restarts: int) -> Manifest:
    """The JobSet around the rendered Job (its metadata and spec), with the JobSet's own network."""
    template_labels = job["spec"]["template"]["metadata"]["labels"]
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": copy.deepcopy(job["metadata"]),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "failurePolicy": {
                "maxRestarts": restarts,
                "rules": [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
            },
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {"metadata": {"labels": dict(template_labels)}, "spec": copy.deepcopy(job["spec"])},
                }
            ],
        },
    }
