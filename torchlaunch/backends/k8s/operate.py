"""The Kubernetes backend: a Job (Indexed, one pod per node) named by the pod's downward-API labels.

`state` asks kubectl when it is installed (in Slurm's words: COMPLETED, FAILED, RUNNING, PENDING);
`cancel` prints the exact `kubectl delete job` for the user to run where the cluster's credentials
are, since the run dir's host need not have them. The manifest is torchlaunch.backends.k8s.manifest's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchlaunch import backends, contract
from torchlaunch.backends import Detected, JobState, LaunchRecord, Step
from torchlaunch.base.procs import tool_output

K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A DNS-1123 label: only such a name reaches a kubectl command."""


def state(name: str, namespace: str | None) -> JobState | None:
    """A Kubernetes Job's state in the project's words, from its conditions and pod counts."""
    if not K8S_NAME.match(name) or (namespace is not None and not K8S_NAME.match(namespace)):
        return None
    argv = ["kubectl", "get", "job", name, "-o", "json"] + (["--namespace", namespace] if namespace else [])
    out = tool_output(argv)
    if not out:
        return None
    try:
        job = json.loads(out)
        status = job.get("status", {}) if isinstance(job, dict) else {}
    except ValueError:
        return None
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or [] if isinstance(c, dict)}
    if conditions.get("Complete") == "True":
        return JobState("finished", "Complete")
    if conditions.get("Failed") == "True":
        return JobState("failed", "Failed")
    if status.get("active"):
        return JobState("running", "active, ready") if status.get("ready") else JobState("pending", "active, not ready")
    return JobState("pending", "no active pod")


class Kubernetes:
    name = "k8s"
    by_pid = False

    def detect(self, env: Mapping[str, str]) -> Detected | None:
        """A pod of a Job rendered by torchlaunch.backends.k8s.launch (its name and namespace from the downward API)."""
        job = env.get(contract.K8S_JOB)
        if not (job and env.get(contract.KUBERNETES_SERVICE_HOST)):
            return None
        namespace = env.get(contract.K8S_NAMESPACE)
        return Detected(self.name, job, {"namespace": namespace} if namespace else {})

    def state(self, job_id: str, extra: Mapping[str, str]) -> JobState | None:
        return state(job_id, extra.get("namespace"))

    def alive(self, job_id: str) -> bool:
        return True  # judged by whoever holds the cluster's credentials, never from a run dir

    def cancel(self, run_dir: Path, nodes: Sequence[LaunchRecord]) -> list[Step]:
        node0 = min(nodes, key=lambda r: r.node_rank)
        if not node0.job_id or not K8S_NAME.match(node0.job_id):
            from torchlaunch.backends.launchers import signal_launchers

            return signal_launchers(nodes)
        where: list[str] = []
        namespace = node0.extra.get("namespace")
        if namespace and K8S_NAME.match(namespace):
            where = ["--namespace", namespace]
        job = ["kubectl", "delete", "job", node0.job_id, "--wait=false", *where]
        # Live mode's membership service (a Deployment, its Service and policy, all NAME-lighthouse)
        # outlives the Job by design; nothing of it exists for other jobs, hence --ignore-not-found.
        service = ["kubectl", "delete", "deployment,service,networkpolicy", f"{node0.job_id}-lighthouse"]
        service += ["--ignore-not-found", "--wait=false", *where]
        return [Step("print", tuple(job)), Step("print", tuple(service))]

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        return []  # the pods' logs are the cluster's (kubectl logs); RUN_DIR/logs has every rank's

    def claim(self, job_id: str, run_dir: Path) -> None:
        pass  # proven by the record the pod writes into the shared run dir

    launcher = "torchlaunch.backends.k8s.launch"

    def render(self, spec: Any, options: Any) -> str:
        """The manifests as YAML (launch.k8s.manifests, launch.k8s.to_yaml); `options` is the launcher's
        (K8sOptions, recipe text) as its plan returns them."""
        k8s = backends.load_launcher(self.launcher)
        opts, recipe_text = options
        return str(k8s.to_yaml(k8s.manifests(spec, opts, recipe_text)))

    def submit(self, argv: Sequence[str]) -> int:
        """The launcher prints the manifests for `kubectl apply -f -` where the cluster's credentials are:
        this host need not have them."""
        return int(backends.load_launcher(self.launcher).main(list(argv)))


BACKEND = Kubernetes()
