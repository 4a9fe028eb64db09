"""test_seams_backends: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_seams.py.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import launcher_argv, run_proc
from tests.unit.test_seams import (
    REPO,
    HostProcesses,
    host_processes,  # noqa: F401 (fixtures, used by name)
    install_package,
)
from torchlaunch import backends
from torchlaunch.jobs import cli, record


def test_an_example_backend_is_operated_by_status_logs_cancel_and_list(
    host_processes: HostProcesses, tmp_path: Path
) -> None:
    """Registering the class above is the whole change: the job record, status, logs, list and cancel
    go through it (the run-dir lock too, through backends.alive)."""
    run = tmp_path / "runs" / "example"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    job_id = str(child.pid)
    host_processes.children[job_id] = child
    found = record.scheduler_from_env({"EXAMPLE_HOST_PROCESS_JOB": job_id})
    assert found == ("host-process", job_id, {})
    record.start(run, scheduler=found[0], job_id=found[1], command=["example"], launch_id="L1")
    (run / "logs").mkdir()
    (run / "logs" / "rank-0.log").write_bytes(b"2026-12-01T09:51:00.123Z hello from rank 0\n")

    def ops(*argv: str) -> str:
        out = io.StringIO()
        assert cli.main(list(argv), out=out) == 0
        return out.getvalue()

    assert "state:      running" in ops("status", str(run))
    assert "scheduler:  host-process  job " + job_id in ops("status", str(run))
    assert ops("logs", str(run)).splitlines() == ["[rank 0] hello from rank 0"]
    assert "example" in ops("list", str(tmp_path / "runs")) and "running" in ops("list", str(tmp_path / "runs"))
    assert backends.alive("host-process", job_id) is True  # what the run-dir lock asks
    assert f"kill -TERM {job_id}" in ops("cancel", str(run), "--dry-run")
    assert f"kill -TERM {job_id}" in ops("cancel", str(run))
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert "state:      cancelled" in ops("status", str(run))
    assert backends.alive("host-process", job_id) is False


def test_a_backend_installed_as_a_package_is_found_and_operated_end_to_end(tmp_path: Path) -> None:
    """The whole change for a new scheduler: one module and one entry-point line in its package's
    metadata. Fresh interpreters (as users run them) record a job of it, then `status` and `cancel`
    reach it through the registry; a second, broken entry point costs one line and nothing else."""
    site = tmp_path / "site"
    install_package(
        site,
        "[torchlaunch.backends]\npid-on-this-host = pid_backend:BACKEND\nbroken = no_such_module_anywhere:BACKEND\n",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    run = tmp_path / "run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:

        def python(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
            )

        recorded = python(
            "-c",
            "import sys; from torchlaunch.jobs import record; "
            "found = record.scheduler_from_env({'PID_BACKEND_JOB': sys.argv[2]}); print(found[0]); "
            "record.start(sys.argv[1], scheduler=found[0], job_id=found[1], command=['sleep'], launch_id='L1')",
            str(run),
            str(sleeper.pid),
        )
        assert recorded.returncode == 0 and recorded.stdout.strip() == "pid-on-this-host", recorded.stderr
        status = python("-m", "launch", "status", str(run))
        assert status.returncode == 0, status.stderr
        assert "state:      running" in status.stdout
        assert f"scheduler:  pid-on-this-host  job {sleeper.pid}" in status.stdout
        broken = [line for line in status.stderr.splitlines() if "no_such_module_anywhere" in line]
        assert len(broken) == 1 and broken[0].startswith("torchlaunch: backend 'no_such_module_anywhere:BACKEND'")
        cancel = python("-m", "launch", "cancel", str(run))
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert f"kill -TERM {sleeper.pid}" in cancel.stdout
        assert sleeper.wait(timeout=60) == -signal.SIGTERM
        assert "state:      cancelled" in python("-m", "launch", "status", str(run)).stdout
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        sleeper.wait(timeout=30)


def test_status_answers_past_installed_backends_that_hang_exit_or_impersonate(tmp_path: Path) -> None:
    """Issue 52: an installed backend whose import hangs hung `launch status`; one raising SystemExit ended
    it with exit 3 and no output; one named `slurm` replaced the built-in. Fresh interpreters, as users
    run them: `status` answers within the import bound, one line per plug-in on stderr."""
    import time

    site = tmp_path / "site"
    install_package(
        site,
        "[torchlaunch.backends]\nexits = exits_backend:BACKEND\nhangs = hangs_backend:BACKEND\n"
        "slurm = impostor_backend:BACKEND\n",
    )
    (site / "exits_backend.py").write_text("raise SystemExit(3)\n")
    (site / "hangs_backend.py").write_text("import time\ntime.sleep(600)\n")  # the plug-in's hang, not the test's
    (site / "impostor_backend.py").write_text(
        "class B:\n    name = 'slurm'\n    by_pid = False\n    launcher = 'x'\nBACKEND = B()\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    run = tmp_path / "run"
    record.start(run, scheduler="slurm", job_id="4242", command=["train"], launch_id="S1")
    start = time.monotonic()
    status = run_proc(launcher_argv("launch", "status", str(run), "--no-scheduler"), timeout=120, env=env)
    assert time.monotonic() - start < 60, "status waited for a plug-in"
    assert status.returncode == 0 and "state:" in status.stdout, status.stdout + status.stderr
    assert "scheduler:  slurm  job 4242" in status.stdout
    lines = [line for line in status.stderr.splitlines() if line.startswith("torchlaunch: backend")]
    assert len(lines) == 3, status.stderr
    assert "'exits_backend:BACKEND' not loaded: its import raised SystemExit: 3" in lines[0]
    assert "'hangs_backend:BACKEND' not loaded: its import did not return within 10 s" in lines[1]
    assert "'impostor_backend:BACKEND' not loaded: 'slurm' is a built-in backend's name" in lines[2]
