"""test_k8s: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_k8s.py.
"""

from __future__ import annotations

import socket
import time

from tests.unit.test_k8s import render, run_pod_script, spec_opts
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.exit_codes import FAILURE


def test_pod_script_waits_for_pod_zero_on_other_pods_only(tmp_path):
    spec, opts = spec_opts()
    spec = spec.replace(overrides=("data.root=a dir/with space",))
    first = run_pod_script(tmp_path, 0, spec, opts)
    assert len(first) == 1 and first[0].startswith("-m torchlaunch.backends.local.launch --nnodes 3 --node-rank 0 ")
    assert "--master-addr run-0.run --master-port 29500 --gpus 4 --config /config/smoke.yaml" in first[0]
    assert first[0].endswith("run_dir=/shared/runs/run data.root=a dir/with space")
    second = run_pod_script(tmp_path, 2, spec, opts)
    assert second[0] == "-m torchlaunch.backends.k8s.launch --wait-for run-0.run:29500 --wait-timeout-s 600"
    assert "--node-rank 2 " in second[1]


def test_wait_for_returns_once_the_port_accepts():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert k8s.wait_for(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5)


def test_wait_for_gives_up_within_its_bound():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert not k8s.wait_for(f"127.0.0.1:{port}", timeout_s=1.5, poll_s=0.2)
    assert time.monotonic() - start < 5
    code, _, err = render(["--wait-for", f"127.0.0.1:{port}", "--wait-timeout-s", "1"])
    assert code == FAILURE and "did not accept connections" in err
