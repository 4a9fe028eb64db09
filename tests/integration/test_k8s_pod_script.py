"""test_k8s_pod_script: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_k8s.py.
"""

from __future__ import annotations

import socket
import subprocess
import time

from tests.unit.test_k8s import render, run_pod_script, spec_opts
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.backends.k8s import live as k8s_live
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.exit_codes import FAILURE


def test_pod_script_waits_for_pod_zero_on_other_pods_only(tmp_path):
    spec, opts = spec_opts()
    spec = spec.replace(overrides=("data.root=a dir/with space",))
    first = run_pod_script(tmp_path, 0, spec, opts)
    assert len(first) == 1 and first[0].startswith("-m torchlaunch.agent --nnodes 3 --node-rank 0 ")
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


def test_live_pod_script_waits_for_the_service_on_every_pod_and_passes_its_address_whole(tmp_path):
    """Live mode (torchlaunch.backends.k8s.live): pod 0 and pod 1 alike wait for the membership service,
    not for pod 0, and the address reaches the launcher as one word although `[` is a shell glob (a file
    that the glob would match lies in the working directory)."""
    own = "http://[fd00::1]:29510"
    spec, opts = spec_opts(live=k8s_live.Live(address=own))
    spec = spec.replace(overrides=(*spec.overrides, f"recovery.lighthouse={own}"))  # as plan() passes it on
    (tmp_path / "recovery.lighthouse=http:").mkdir()  # what an unquoted [fd00::1] would expand to
    (tmp_path / "recovery.lighthouse=http:" / "f:29510").touch()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(
        '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done >> "$CALLS"; echo --- >> "$CALLS"\n'
    )
    (fake / "python").chmod(0o755)
    for index in (0, 1):
        calls = tmp_path / f"calls-{index}"
        env = {"PATH": f"{fake}:/usr/bin:/bin", "JOB_COMPLETION_INDEX": str(index), "CALLS": str(calls)}
        env |= {"MASTER_ADDR": "run-0.run", "MASTER_PORT": "29500"}
        subprocess.run(
            ["/bin/sh", "-c", k8s_manifest.pod_script(spec, opts)], env=env, cwd=tmp_path, check=True, timeout=30
        )
        wait, launch, _ = calls.read_text().split("---\n")
        assert wait.splitlines() == [
            "-m",
            "torchlaunch.backends.k8s.launch",
            "--wait-for",
            "fd00::1:29510",
            "--wait-timeout-s",
            "600",
        ]
        words = launch.splitlines()
        assert words[words.index("--node-rank") + 1] == str(index)
        assert [w for w in words if w.startswith("recovery.lighthouse=")] == [f"recovery.lighthouse={own}"]
    rendered_service = k8s_live.Live()
    spec, opts = spec_opts(live=rendered_service)
    assert f"recovery.lighthouse={k8s_live.address('run', rendered_service)}" in k8s_manifest.pod_script(spec, opts)
