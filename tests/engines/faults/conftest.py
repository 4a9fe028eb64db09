"""Fixtures for the fault suite: a fresh 2-node cluster per test, skipped where netns cannot run."""

from __future__ import annotations

import os
import random

import pytest

from faults import netns

SEED = os.environ.get("FAULTS_SEED", "1234")


@pytest.fixture
def cluster():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from faults.netns import Cluster

    with Cluster() as c:
        yield c


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Seeded per test, so a failing fault point reproduces with the same FAULTS_SEED."""
    return random.Random(f"{SEED}:{request.node.name}")
