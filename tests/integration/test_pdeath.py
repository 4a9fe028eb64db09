"""Children die with the launcher: SIGKILL the parent (real processes), the child is gone within a bound.

Waiting uses pidfds (readable when the process exits), so the tests wait on the event itself; the
bound only decides how long a failing test takes to fail.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO as ROOT
from tests.conftest import launcher_argv
from torchlaunch import pdeath

BOUND_S = 60.0

pytestmark = pytest.mark.skipif(not pdeath.supported() or not hasattr(os, "pidfd_open"), reason="Linux prctl/pidfd")

# A launcher stand-in: starts CHILD_CODE with or without die_with_parent(), reports the child's pid,
# then waits to be killed.
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from torchlaunch import pdeath
    argv, guarded, new_session = sys.argv[1:-2], sys.argv[-2] == "1", sys.argv[-1] == "1"
    child = subprocess.Popen(
        argv,
        preexec_fn=pdeath.die_with_parent() if guarded else None,
        start_new_session=new_session,
        env={**os.environ, **pdeath.launcher_env()},
    )
    print(child.pid, flush=True)
    time.sleep(3600)  # stands in for the launcher's work; the test SIGKILLs it
    """
)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def start_parent(
    child: list[str], *, guarded: bool, new_session: bool = True, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *child, "1" if guarded else "0", "1" if new_session else "0"],
        stdout=subprocess.PIPE,
        env={**env(), **(extra_env or {})},
    )
    return parent, int(readline(parent))


def readline(proc: subprocess.Popen[bytes], bound_s: float = BOUND_S) -> str:
    """The next line `proc` prints, waiting at most bound_s (then its tree is killed and the test fails)."""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + bound_s
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            pdeath.kill_tree(proc.pid)
            pytest.fail(f"no line from {proc.args[:3]} within {bound_s:.0f} s (got {line!r})")
        char = os.read(fd, 1)
        if not char:
            break
        line += char
    return line.decode()


def gone_within(pid: int, bound_s: float = BOUND_S) -> bool:
    """True once `pid` has exited (a zombie counts: it runs nothing), waiting at most bound_s."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], bound_s)
        return bool(readable)
    finally:
        os.close(fd)


def kill_parent(parent: subprocess.Popen[bytes]) -> None:
    parent.send_signal(signal.SIGKILL)
    parent.wait()


def test_child_dies_when_the_launcher_is_sigkilled():
    parent, child = start_parent(SLEEPER, guarded=True)
    kill_parent(parent)
    assert gone_within(child)


def test_control_without_it_the_child_trains_on():
    """The harness detects a survivor: an unguarded child in its own session outlives a SIGKILLed parent."""
    parent, child = start_parent(SLEEPER, guarded=False)
    kill_parent(parent)
    try:
        assert not gone_within(child, bound_s=1.0)  # still running after the parent is gone
    finally:
        os.kill(child, signal.SIGKILL)
    assert gone_within(child)


WATCHED = (
    "from torchlaunch import pdeath; import time; pdeath.set_pdeathsig = lambda sig: False; "
    "assert pdeath.die_with_parent_now() == 'watcher'; print('watching', flush=True); time.sleep(3600)"
)


def test_without_prctl_a_watcher_ends_the_orphan():
    """The fallback where the kernel has no death signal: a thread notices the reparenting."""
    parent, child = start_parent([sys.executable, "-c", WATCHED], guarded=False)
    assert readline(parent) == "watching\n"  # the child's stdout is its parent's
    kill_parent(parent)
    assert gone_within(child)


def test_pdeathsig_is_set_in_the_child_and_survives_exec():
    code = "from torchlaunch import pdeath; print(pdeath.get_pdeathsig())"
    out = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=pdeath.die_with_parent(signal.SIGTERM), env=env(), capture_output=True
    )
    assert out.stdout.decode().strip() == str(int(signal.SIGTERM))


def test_an_orphan_kills_itself_at_once():
    """The race: the parent died before the death signal was set; the process finds itself reparented."""
    code = "from torchlaunch import pdeath; pdeath.die_with_parent_now(parent=-5); print('survived')"
    out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL and "survived" not in out.stdout


def test_worker_whose_agent_already_left_the_launcher_kills_itself():
    """The launcher named in the environment is not the parent's parent: the agent was orphaned before
    this worker got to set its death signal."""
    code = "from torchlaunch import pdeath; pdeath.die_with_agent(); print('survived')"
    orphaned = {**env(), pdeath.AGENT_ENV: "run", pdeath.LAUNCHER_PID_ENV: str(os.getppid() + 1)}
    out = subprocess.run([sys.executable, "-c", code], env=orphaned, capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL and "survived" not in out.stdout
    kept = {**orphaned, pdeath.LAUNCHER_PID_ENV: str(os.getppid())}  # our parent is the child's grandparent
    out = subprocess.run([sys.executable, "-c", code], env=kept, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "survived"


def test_die_with_agent_only_under_torchrun():
    code = "from torchlaunch import pdeath; print(pdeath.die_with_agent(), pdeath.get_pdeathsig())"
    plain = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    agent = subprocess.run(
        [sys.executable, "-c", code], env={**env(), pdeath.AGENT_ENV: "run"}, capture_output=True, text=True
    )
    assert plain.stdout.split() == ["None", "0"]
    assert agent.stdout.split() == ["prctl", str(int(signal.SIGKILL))]


# The torchrun shape: launcher -> agent (guarded by preexec) -> worker in a new session that guards itself.
AGENT = textwrap.dedent(
    """
    import subprocess, sys, time
    worker = subprocess.Popen(sys.argv[1:], start_new_session=True)  # as torch.distributed.elastic does
    print(worker.pid, flush=True)
    time.sleep(3600)
    """
)
WORKER = "from torchlaunch import pdeath; import time; pdeath.die_with_agent(); time.sleep(3600)"


def test_worker_in_its_own_session_dies_with_agent_and_launcher(tmp_path):
    agent_cmd = [sys.executable, "-u", "-c", AGENT, sys.executable, "-c", WORKER]
    parent, agent = start_parent(agent_cmd, guarded=True, extra_env={pdeath.AGENT_ENV: "run"})
    worker = int(readline(parent))  # the agent's stdout is the parent's
    kill_parent(parent)
    assert gone_within(agent)
    assert gone_within(worker)


def test_kill_tree_reaches_descendants_in_other_sessions():
    agent_cmd = [sys.executable, "-u", "-c", AGENT, *SLEEPER]
    root = subprocess.Popen(agent_cmd, stdout=subprocess.PIPE, start_new_session=True)
    worker = int(readline(root))
    assert pdeath.descendants(root.pid) == [worker]
    assert set(pdeath.kill_tree(root.pid)) == {root.pid, worker}
    root.wait()
    assert gone_within(worker)


WORKER_SCRIPT = textwrap.dedent(
    """
    import os, time
    from torchlaunch import pdeath
    # one write(2), atomic on a pipe: the suite runs children unbuffered, where print's pieces of two
    # workers interleave on the launcher's shared stdout
    os.write(1, f"worker {os.getpid()} {pdeath.die_with_agent()}\\n".encode())
    time.sleep(3600)
    """
)


@pytest.mark.slow
def test_real_torchrun_agent_and_workers_die_with_the_launcher(tmp_path):
    """torchrun starts workers in new sessions without a death signal; the guard on the agent plus the
    runner's die_with_agent in each worker ends the whole tree when the launcher is SIGKILLed."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    torchrun = launcher_argv("torchlaunch.launch.torchrun", "--standalone", "--nproc-per-node", "2")
    parent, agent = start_parent([*torchrun, str(script)], guarded=True)
    workers = []
    while len(workers) < 2:
        line = readline(parent, bound_s=180.0)  # two interpreters start on a loaded 2-core CI box
        assert line, "torchrun ended before its workers started"
        if line.startswith("worker "):
            _, pid, how = line.split()
            assert how == "prctl"
            workers.append(int(pid))
    kill_parent(parent)
    assert gone_within(agent)
    assert all(gone_within(pid) for pid in workers)


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
def test_the_live_agents_membership_service_and_ranks_die_with_the_launcher(tmp_path):
    """The default road on one node: the launcher's live agent runs torchft's Lighthouse as a process of
    its own. A SIGKILLed launcher takes the agent along (PDEATHSIG), and the service and every rank end
    with it (the service's stdin pipe from the agent closes; found orphaned after a CI run, holding its
    port)."""
    launcher = subprocess.Popen(
        launcher_argv(
            "launch.local",
            "--gpus",
            "2",
            "--device",
            "cpu",
            "--config",
            "configs/smoke.yaml",
            f"run_dir={tmp_path / 'run'}",
            "train.epochs=50",
        ),  # fmt: skip
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 180.0  # two ranks start on a loaded 2-core box
        while not any("torchlaunch.live.lighthouse" in cmdline(p) for p in tree) or len(tree) < 4:
            assert launcher.poll() is None, launcher.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, [cmdline(p) for p in tree]
            time.sleep(0.1)  # polling /proc: a process's start is no event this test can wait on
            tree = pdeath.descendants(launcher.pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        left = [cmdline(p) for p in tree if not gone_within(p, bound_s=30.0)]
        assert left == [], f"outlived the SIGKILLed launcher: {left}"
    finally:
        pdeath.kill_tree(launcher.pid)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        for pid in tree:  # what a failing run left orphaned: not this suite's to leave behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
