"""Fixtures for the fault suite: a fresh 2-node cluster per test, skipped where netns cannot run."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

SEED = int(os.environ.get("FAULTS_SEED", "1234"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netns: needs root and network namespaces (ip netns)")


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (apt-get install iproute2 util-linux mount)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


@pytest.fixture
def cluster():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    from faults.netns import Cluster

    with Cluster() as c:
        yield c


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Seeded per test, so a failing fault point reproduces with the same FAULTS_SEED."""
    return random.Random(f"{SEED}:{request.node.name}")
