"""Kubernetes rendering of live recovery (recovery.live=true, docs/live.md): pure dicts, launch.py assembles.

    python -m launch.k8s --nodes 2 --gpus-per-node 8 --config configs/cifar10.yaml recovery.live=true

What live mode changes in the rendering, and why:

- **The membership service is its own Deployment + ClusterIP Service `<name>-lighthouse`.** torchft's
  Lighthouse must survive the loss of any training pod, so it runs in none of them (the same reason it
  runs on a host of its own under launch.local). Its state is soft (the ranks' heartbeats refill it), so
  a Deployment that starts it again anywhere, behind the same Service name, is all it needs. One
  replica, `Recreate`: a rolling update would run an old and a new service behind the name at once, and
  ranks asking different services could be handed different groups.
- **The workers run launch.local in live mode.** Each pod's command gets
  `recovery.lighthouse=http://<name>-lighthouse:29510` (unless the recipe or an override names a
  service of the user's own: then no service is rendered). The name is relative: the pods resolve it
  in their own namespace, whichever `kubectl apply -n` chose.
- **A lost pod is replaced for its index while the others train on.** The Job's budget of failures is
  per index (backoffLimitPerIndex), so pods killed on one node never spend the others' budget and never
  fail the Job; an index that spent its budget is failed alone (its node keeps dying) and the others
  go on without it. Exit 2 fails its index, not the Job (FailIndex): bad input is still never retried,
  and since every pod reads the same recipe and volume, it fails every index and so the Job; but a pod
  whose group was superseded also exits 2 (live/fence.py's Fenced), and must not take the
  group that superseded it down. The Job is done when one index succeeds (successPolicy
  succeededCount 1): a live agent ends 0 only when the training finished, and a replacement still
  waiting for a node must not keep the Job open.
- **Pod 0 is not special.** Every pod waits (bounded) for the membership service, none for pod 0: the
  first group still meets at pod 0's port (MASTER_ADDR is pod 0's name `<name>-0.<name>`), but a
  replacement pod joins through the service and a live peer's store, so a replacement of pod 1 after
  pod 0 was lost, or of pod 0 itself, starts at once. Its launcher never looks pod 0's name up (a lost
  pod's DNS record goes with it): launch.local checks that --master-addr resolves only on a launcher
  that starts in the first group (torchlaunch.agent.options.meets_at_node_0_first), and a
  replacement's is not one. A first launch's pods start in any order: a first-group pod whose launcher
  runs before pod 0's name has a DNS record waits for it (`--master-wait-s`, the rendering's
  --wait-timeout-s, 600 s by default; then exit 1, counted against its index) instead of being refused.
- **The network.** Between the job's pods every TCP port (each rank hosts its own store on a free port)
  and UDP (each rank answers a one-datagram echo on its store's port: live/peers.py); the
  service accepts only the job's pods, on its two ports (the Lighthouse's and presence's, the next),
  and opens no connection itself.

**A node range, `--nodes MIN:MAX`** (launch.local's live range, docs/live.md): the same Job with MAX
pods (completions = parallelism = MAX), every pod running `launch.local --nnodes MIN:MAX --node-rank
$JOB_COMPLETION_INDEX` in live mode. The pods meet in the shared run dir: the first group is sealed at
once when all MAX are in, or with MIN once the last call (10 s) has passed, so a pod left Pending (fewer
nodes than MAX) holds nobody up; it joins the group that trains when it runs. `--master-addr` is the
service's host, not pod 0's name: in a range no node hosts the job's store (the first group's is on its
first sealed node, at the address that node arrived with), the launcher only needs a name that every
pod resolves alike, and a Pending pod 0 has no DNS record (its name would not resolve, and the launcher
would refuse it: exit 2, failing the index). The Job's policy is the fixed count's, and each rule holds
for the range's codes too: below MIN the ranks left commit the last whole step and exit 75, which is
Ignored, so their indexes are started again without spending a budget, and meet afresh: sealed once MIN
are in, they resume from that checkpoint (no MIN within the launcher's join timeout, 600 s: exit 1,
counted against its index). Exit 2 (bad input, a superseded member) fails its index; one index ending 0
ends the Job, Pending pods included.

Not rendered with live mode, one line and exit 2: `--jobset` (its failure policy restarts every pod,
which live mode is there to avoid).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchlaunch import roads
from torchlaunch.backends.k8s import hardening
from torchlaunch.backends.k8s import validate as k8s_validate
from torchlaunch.base import rules
from torchlaunch.exit_codes import BAD_INPUT
from torchlaunch.launch import cli, shape
from torchlaunch.launch.spec import JobSpec

if TYPE_CHECKING:
    from torchlaunch.config import RecoveryConfig

Manifest = dict[str, Any]

LIVE = roads.get("live")
"""The live road (torchlaunch.roads): its service's module, default address, presence port and secret file."""
PORT = int(LIVE.default_bind.rpartition(":")[2])
"""The service's port: `python -m launch.lighthouse`'s default, so a user's own service matches it."""
PRESENCE_PORT = LIVE.presence.port_of(PORT)
"""Where each seated rank holds its presence connection (live/presence.py): the next port."""
PRESENCE = "presence"
COMPONENT = "lighthouse"
CONTAINER = "lighthouse"
SERVICE_MODULE = LIVE.service
"""What `python -m launch.lighthouse` runs; the image has the package, not the repository's launch/."""
PER_INDEX_BACKOFF = 3
"""Failures tolerated per index when --backoff-limit is not given: the fixed-size Job's 3 per node."""
RESOURCES = {"cpu": "500m", "memory": "1Gi"}
"""Measured: the service held 606 MB resident while torchft's package (torch) was imported; ~25 MB since it
loads the bindings alone (live/lighthouse.py), left as it was; it idles between quorums;
requests = limits, so it is the last pod a node under memory pressure evicts."""


@dataclass(frozen=True)
class SharedRunDir:
    """The workers' shared volume, which holds the run dir and so the run's secret: the service mounts it
    read-only and proves every rank's presence against a key derived from the secret (`--secret-file`),
    so a stranger's forged presence ids are never counted (issue 52)."""

    claim: str
    """The workers' PersistentVolumeClaim (RWX: every pod mounts it)."""
    mount_path: str
    """Where the workers mount it; the service mounts it at the same path, so the run dir names alike."""
    run_dir: str
    """The run dir as the workers see it (normalised, under mount_path)."""


@dataclass(frozen=True)
class Live:
    """What the rendering needs of a run's recovery section in live mode."""

    heartbeat_timeout_ms: int = 1000
    """recovery.heartbeat_timeout_s: the service forms a group without a rank silent this long."""
    address: str = ""
    """recovery.lighthouse as the user gave it (a service of their own); empty: the rendered one."""


def from_config(recovery: RecoveryConfig, doctor: bool, *, jobset: bool, ranks: int) -> Live | None:
    """Live mode's settings, or None when the rendering takes the restart road. --doctor runs the
    distributed pre-flight, which launch.local runs under torchrun in every mode: no service to render
    for it. Under recovery.live=auto (the default) a --jobset (check says why) or a one-rank run takes
    the restart road (pinned); an explicit true is rendered as it always was, and check refuses it with
    --jobset."""
    possible = LIVE.insisted(recovery.live) or (ranks > 1 and not jobset)
    if doctor or not LIVE.takes(recovery.live, possible):
        return None
    return Live(round(recovery.heartbeat_timeout_s * 1000), recovery.lighthouse)


def pinned(recovery: RecoveryConfig, live: Live | None, doctor: bool, ranks: int) -> tuple[str, ...]:
    """What the pods' command adds so that their launch.local takes the rendered road: a multi-rank restart
    road that recovery.live=auto chose here (--jobset) would be live in a pod's launcher, which sees only
    its recipe; so the pods get recovery.live=false. Nothing otherwise (the pods' auto is the rendering's)."""
    auto = not (LIVE.insisted(recovery.live) or LIVE.declined(recovery.live))  # recovery.live=auto, as unsaid
    restarts = live is None and not doctor and ranks > 1 and auto
    return ("recovery.live=false",) if restarts else ()


def check(spec: JobSpec, jobset: bool) -> None:
    """The shapes live mode does not render, one line each, before anything is printed. A range's own
    bounds (MIN >= 1, MIN <= MAX) are launch.shape's, checked as every launcher's."""
    if jobset:  # under auto (the default) a --jobset takes the restart road: from_config
        raise cli.error(
            "recovery.live=true is not rendered as a --jobset yet (the JobSet's restart of every pod is what "
            "live mode avoids); leave out --jobset: the Indexed Job replaces a lost pod by itself"
        )


def nodes_args(spec: JobSpec) -> list[str]:
    """launch.local's node options in a live pod: its index as its node rank, with the fixed count or the
    range (live mode numbers its nodes in a range too: a rank's files and replica id follow its node)."""
    count = str(spec.nodes) if spec.min_nodes is None else shape.NodeRange(spec.min_nodes, spec.nodes).torchrun()
    return ["--nnodes", count, "--node-rank", '"$JOB_COMPLETION_INDEX"']


def master_wait_args(spec: JobSpec, wait_timeout_s: int) -> list[str]:
    """launch.local's --master-wait-s for a fixed count: a first launch's pods start in any order, and a
    first-group pod whose launcher runs before pod 0's name has a DNS record waits for it (bounded, then
    exit 1, counted against its index) instead of being refused (exit 2, FailIndex: its index failed for
    good on a normal start). A replacement never looks the name up, so never waits for it. A range's
    --master-addr is the service's host, which every pod waited for already: nothing to add."""
    return ["--master-wait-s", str(wait_timeout_s)] if spec.min_nodes is None else []


def master_addr(name: str, spec: JobSpec, live: Live, pod0: str) -> str:
    """Every pod's --master-addr: pod 0's name for a fixed count (the first group meets at its store); for
    a range the service's host, which resolves while any pod is Pending (see the module docstring)."""
    if spec.min_nodes is None:
        return pod0
    return host_port(name, live)[0]


def service_name(name: str) -> str:
    """The Deployment's, the Service's and its NetworkPolicy's name: `<name>-lighthouse`, or for a --name
    too long for that label (<= 63 characters) its head, a digest of the whole name and the suffix. Live
    mode is the default, and a name that fits the rendering's other objects must not be refused, nor
    change the run's road, for the sake of a name the user never wrote."""
    full = f"{name}-{COMPONENT}"
    if len(full) <= k8s_validate.LABEL_MAX:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    head = name[: k8s_validate.LABEL_MAX - len(COMPONENT) - len(digest) - 2].rstrip("-")
    return f"{head}-{digest}-{COMPONENT}"


def address(name: str, live: Live) -> str:
    """recovery.lighthouse of every pod: the user's service, or the rendered one by its Service name."""
    return live.address or f"http://{service_name(name)}:{PORT}"


def host_port(name: str, live: Live) -> tuple[str, int]:
    """The service's host and port."""
    found = rules.service_address(address(name, live))
    if found is None:  # the recipe's check refused it already; a caller passing one by hand is told
        raise cli.error(f"recovery.lighthouse must be http://HOST:PORT, got {address(name, live)!r}")
    return found


def endpoint(name: str, live: Live) -> str:
    """HOST:PORT the pods wait for before they start (`launch.k8s --wait-for`)."""
    host, port = host_port(name, live)
    return f"{host}:{port}"


def overrides(name: str, live: Live) -> list[str]:
    """What the pods' command adds to the user's overrides: the rendered service's address."""
    return [] if live.address else [f"recovery.lighthouse={address(name, live)}"]


def renders_service(live: Live) -> bool:
    return not live.address


def pod_labels(name: str) -> dict[str, str]:
    """The service pod's labels. Its app name differs from the workers' (`torchlaunch`), so neither the
    workers' headless Service nor their NetworkPolicy selects it; `app.kubernetes.io/instance=<name>`
    still selects every pod of the run."""
    return {
        "app.kubernetes.io/name": f"torchlaunch-{COMPONENT}",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": COMPONENT,
    }


def container(image: str, live: Live, shared: SharedRunDir) -> Manifest:
    """The service's process under tini (PID 1: SIGTERM reaches it, it shuts down at once), given the run's
    secret on the shared volume, mounted read-only: it only reads it, once the first rank made it."""
    return {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "Always",
        "command": ["/usr/bin/tini", "--", "python", "-m", SERVICE_MODULE],
        "args": [
            "--bind",
            f"0.0.0.0:{PORT}",
            "--heartbeat-timeout-ms",
            str(live.heartbeat_timeout_ms),
            "--secret-file",
            LIVE.runkey.secret_file(shared.run_dir),
        ],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [
            {"name": COMPONENT, "containerPort": PORT, "protocol": "TCP"},
            {"name": PRESENCE, "containerPort": PRESENCE_PORT, "protocol": "TCP"},
        ],
        # Ready once it listens: the Service sends no rank to it before, and the pods wait for that.
        "readinessProbe": {"tcpSocket": {"port": COMPONENT}, "periodSeconds": 2},
        # A service that stopped accepting is started again (its state is soft); 30 s covers its start.
        "livenessProbe": {"tcpSocket": {"port": COMPONENT}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {"requests": dict(RESOURCES), "limits": dict(RESOURCES)},
        "securityContext": hardening.container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shared", "mountPath": shared.mount_path, "readOnly": True},
        ],
    }


def deployment(meta: Manifest, name: str, image: str, live: Live, shared: SharedRunDir) -> Manifest:
    """One restartable replica of the service, never two at once (see the module docstring)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": pod_labels(name)},
            "template": {
                "metadata": {"labels": pod_labels(name)},
                "spec": {
                    **hardening.pod_isolation(),
                    "securityContext": hardening.pod_security(fs_group=False),
                    "containers": [container(image, live, shared)],
                    "volumes": [
                        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                        {"name": "shared", "persistentVolumeClaim": {"claimName": shared.claim, "readOnly": True}},
                    ],
                },
            },
        },
    }


def service(meta: Manifest, name: str) -> Manifest:
    """A stable name and virtual IP in front of whichever pod the Deployment runs now."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": pod_labels(name),
            "ports": [
                {"name": COMPONENT, "port": PORT, "targetPort": COMPONENT, "protocol": "TCP"},
                {"name": PRESENCE, "port": PRESENCE_PORT, "targetPort": PRESENCE, "protocol": "TCP"},
            ],
        },
    }


def network_policy(meta: Manifest, name: str, workers: dict[str, str]) -> Manifest:
    """The service takes connections from the job's worker pods on its two ports only, and opens none."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": pod_labels(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": dict(workers)}}],
                    "ports": [{"protocol": "TCP", "port": PORT}, {"protocol": "TCP", "port": PRESENCE_PORT}],
                }
            ],
            "egress": [],
        },
    }


def worker_ports() -> list[Manifest]:
    """What the workers' NetworkPolicy admits from the job's other workers: every TCP port (rendezvous,
    each rank's own store on a free port, gloo/NCCL) and every UDP port (the peer echo on each store's
    port); no other protocol."""
    return [{"protocol": "TCP"}, {"protocol": "UDP"}]


def job(rendered: Manifest, backoff_limit: int | None) -> Manifest:
    """The Indexed Job of live mode from the fixed-size one: failures counted per index, exit 2 fails
    its index, done when one index succeeds (see the module docstring)."""
    out = copy.deepcopy(rendered)
    spec: Manifest = {}
    for key, value in out["spec"].items():
        if key == "backoffLimit":  # unset: Kubernetes then bounds nothing Job-wide (MaxInt32)
            spec["backoffLimitPerIndex"] = PER_INDEX_BACKOFF if backoff_limit is None else backoff_limit
        else:
            spec[key] = value
    for rule in spec["podFailurePolicy"]["rules"]:
        if rule["action"] == "FailJob" and rule.get("onExitCodes", {}).get("values") == [BAD_INPUT]:
            rule["action"] = "FailIndex"
    spec["successPolicy"] = {"rules": [{"succeededCount": 1}]}
    out["spec"] = spec
    return out
