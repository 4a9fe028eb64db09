"""torchft's Lighthouse as the live group's membership service runs it (core/recovery/lighthouse.py),
on loopback, in this process: what the local agent's loss notice (backends/local/live.py) does to it."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from tests.conftest import free_port
from torchlaunch.core.recovery import lighthouse


def test_a_restart_with_the_members_left_forms_a_lone_survivors_group_at_once() -> None:
    """Against torchft's own service: with a dead member's heartbeat still fresh, a lone survivor of
    two gets no group (half or fewer of those heartbeating); told of the loss, the service forgets it
    and the survivor's group forms without waiting for the heartbeat timeout (60 s here)."""
    port = free_port()
    args = lighthouse.parse_args(["--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms", "60000"])
    service = lighthouse.Service(args)
    try:
        client = lighthouse._torchft().LighthouseClient(f"http://127.0.0.1:{port}", timedelta(seconds=5))
        client.heartbeat("rank000001")  # the member about to be lost: its last beat
        with pytest.raises(Exception, match="(?i)timed? ?out|deadline"):
            client.quorum(replica_id="rank000000", timeout=timedelta(seconds=0.5))
        service.forget_lost(1)
        for _ in range(20):  # the first call after a restart may fail once while the client reconnects
            try:
                found = client.quorum(replica_id="rank000000", timeout=timedelta(seconds=5))
                break
            except Exception:
                time.sleep(0.05)
        assert [p.replica_id for p in found.participants] == ["rank000000"]
    finally:
        service.shutdown()
