"""The least-privilege settings every pod of a run shares: the training workers' and, in live mode, the
membership service's (torchlaunch.backends.k8s.live). One owner, so that the two kinds of pods cannot
drift apart: a setting tightened here is tightened for both, and the scanners (checkov) see the same.
"""

from __future__ import annotations

from typing import Any

Manifest = dict[str, Any]

RUN_AS = 10001
"""The image's non-root user and group (docker/Dockerfile)."""


def container_security() -> Manifest:
    """A container's securityContext: non-root, read-only root filesystem, no privilege escalation, every
    capability dropped, the runtime's default seccomp profile (writable paths are emptyDirs and volumes)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security(fs_group: bool = True) -> Manifest:
    """A pod's securityContext: the image's user, and its group owning the mounted volumes (fsGroup). A
    pod that only reads its own user's files on the shared volume (the membership service reading the
    run's secret) is given no fsGroup: the kubelet then changes nothing on the volume for it, and a secret
    made group-readable is refused by the ranks (live/runkey.py)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        **({"fsGroup": RUN_AS} if fs_group else {}),
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_isolation() -> Manifest:
    """No API credentials and no service-discovery environment: the pods talk to no API server, and a
    Service's variables would only leak the namespace's other services into every process."""
    return {"automountServiceAccountToken": False, "enableServiceLinks": False}
