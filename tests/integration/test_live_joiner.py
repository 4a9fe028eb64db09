"""A live launch across a fixed `--nnodes N`: a launcher that replaces a lost node does not need node 0's
name to resolve (node 0 may be the node lost: a Kubernetes pod's DNS record goes with the pod, and
`launch.k8s --nodes N recovery.live=true` gives every pod `--master-addr <name>-0.<name>`). It joins
through the membership service and a live peer's store; only a launcher that starts in the first group
meets at node 0, and for it an unresolvable name is still bad input (one line, exit 2, nothing written).

The job around the launcher under test is its run dir and its run-dir lock, as the other nodes' launchers
leave them: node 0 founded the run and left (lost), node 2's launcher holds the job's lock, and a group
has formed since the founding (RUN_DIR/live/generation past RUN_DIR/live/founded). The replacement is
stopped once it has started its ranks as joiners: what they do next is tests/integration/
test_live_range_two_nodes.py's and tests/engines/test_docker_live.py's (a real group to join).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import live
from tests.conftest import REPO, child_env, free_port, launcher_argv, run_launcher
from torchlaunch import runlock
from torchlaunch.agent import commands, live_start
from torchlaunch.launch import elastic
from torchlaunch.live.fence import Fence

pytestmark = [pytest.mark.timeout(180)]

GONE = "lv-0.lv.invalid"
"""Node 0's name once node 0 is gone: `.invalid` never resolves (RFC 2606)."""
NODES = "3"


class Job:
    """The run dir, recipe and ports of one live job of --nnodes 3 whose node 0 is --master-addr `addr`
    (GONE unless told)."""

    def __init__(self, work: Path, addr: str = GONE) -> None:
        self.addr = addr
        self.run_dir = work / "run"
        self.run_dir.mkdir()
        self.recipe = work / "run.yaml"
        self.recipe.write_text(live.config_text(self.run_dir))
        self.port = free_port()  # nobody listens: a joiner never asks node 0's store
        self.lighthouse = f"http://127.0.0.1:{self._held_ports()}"  # nor does this test run a service
        self.key = elastic.job_key(commands.run_id(str(self.run_dir)), addr, self.port)

    def _held_ports(self) -> int:
        """A port pair that accepts connections (the kernel's backlog; nobody answers) for the job's life:
        the launcher's one look at the service's two ports (agent/lighthouse_reach.py) finds them
        there, and these tests stop before a rank asks the service anything."""
        for _ in range(20):
            first, second = socket.socket(), socket.socket()
            try:
                first.bind(("127.0.0.1", 0))
                second.bind(("127.0.0.1", first.getsockname()[1] + 1))
            except OSError:
                first.close()
                second.close()
                continue
            for sock in (first, second):
                sock.listen(8)
                weakref.finalize(self, sock.close)
            return int(first.getsockname()[1])
        raise RuntimeError("no free loopback port pair")

    def args(self, node: int, *extra: str) -> list[str]:
        """Node `node`'s command, as every pod of the rendering runs it (one CPU rank), with `extra` options."""
        return [
            *("--nnodes", NODES, "--node-rank", str(node), "--master-addr", self.addr, *extra),
            *("--master-port", str(self.port), "--gpus", "1", "--device", "cpu"),
            *("--config", str(self.recipe), f"recovery.lighthouse={self.lighthouse}"),
        ]

    def lock(self) -> runlock.RunLock:
        """A launcher of this job: a member of its run-dir lock."""
        return runlock.RunLock(self.run_dir, job=self.key).acquire()


@pytest.fixture
def trained(tmp_path: Path) -> Iterator[Job]:
    """Node 0 founded the run, the first group formed, node 0 was lost; node 2's launcher lives on."""
    job = Job(tmp_path)
    founder, peer = job.lock(), job.lock()
    try:
        assert live_start.replaces_a_lost_node(founder, str(job.run_dir)) == 0
        Fence(job.run_dir).advance()  # the first group formed
        founder.release()  # node 0 lost, and its name with it
        yield job
    finally:
        peer.release()


def started_ranks(proc: subprocess.Popen) -> tuple[list[str], int | None]:
    """The launcher's lines up to the one that starts its ranks (`launch: <the agent's command>`), then
    its whole process group stopped; or every line and its code when it ended before."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("launch: ") and "torchlaunch.agent.live" in line:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            return lines, None
    return lines, proc.wait(timeout=60)


@pytest.mark.parametrize("wait", [(), ("--master-wait-s", "600")], ids=["no-wait", "master-wait-600"])
def test_a_replacement_of_node_1_joins_while_node_0s_name_does_not_resolve(trained: Job, wait: tuple[str, ...]) -> None:
    """With --master-wait-s 600 too (what launch.k8s renders): a replacement never looks node 0's name up,
    so it never waits for it."""
    argv = launcher_argv("torchlaunch.agent", *trained.args(1, *wait))
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: the launcher, its agent and rank end together
    )
    try:
        lines, code = started_ranks(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    said = "\n".join(lines)
    assert code is None, f"the replacement ended {code} before starting its ranks:\n{said}"
    assert "this job trains already on its other nodes: this node's ranks join its live group" in said, said
    agent = lines[-1]
    assert "--join-attempt 2" in agent and f"--master-addr {GONE}" in agent, agent
    assert time.monotonic() - start < 60, "the replacement waited for node 0's name"


def test_a_first_launch_with_an_unresolvable_node_0_is_bad_input_and_records_nothing(tmp_path: Path) -> None:
    """Node 0 itself, founding the run: one quoted line, exit 2, no config and no founded record."""
    job = Job(tmp_path)
    code, _, err = run_launcher(job.args(0), timeout=120)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--master-addr '{GONE}' does not resolve" in lines[0], err
    assert not (job.run_dir / "config.yaml").exists(), "a refused launch settled the run's config"
    assert not (job.run_dir / "live" / "founded").exists(), "a refused launch recorded a run"


def test_a_first_group_node_with_an_unresolvable_node_0_is_bad_input(tmp_path: Path) -> None:
    """Node 1 of a first launch (node 0's launcher founded the run, no group formed yet) meets at node 0:
    its name must resolve, as without live mode."""
    job = Job(tmp_path)
    founder = job.lock()
    try:
        assert live_start.replaces_a_lost_node(founder, str(job.run_dir)) == 0
        code, _, err = run_launcher(job.args(1), timeout=120)
    finally:
        founder.release()
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--master-addr '{GONE}' does not resolve" in lines[0], err


# ---- a first launch whose nodes start in any order: --master-wait-s ----------------------------------


def test_a_first_group_node_whose_wait_runs_out_ends_1_in_one_line_and_records_nothing(tmp_path: Path) -> None:
    """--master-wait-s S: node 0's name still unresolvable after S s is node 0 or DNS missing, not bad
    input: one line, exit 1 (retryable: on Kubernetes counted against the index, not FailIndex), nothing
    settled."""
    job = Job(tmp_path)
    founder = job.lock()
    try:
        assert live_start.replaces_a_lost_node(founder, str(job.run_dir)) == 0
        start = time.monotonic()
        code, _, err = run_launcher(job.args(1, "--master-wait-s", "2"), timeout=120)
        took = time.monotonic() - start
    finally:
        founder.release()
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--master-addr '{GONE}' still does not resolve after --master-wait-s 2" in lines[0], err
    assert took >= 2, took
    assert not (job.run_dir / "config.yaml").exists(), "a launch that ended waiting settled the run's config"


LATE = "lv-0.late.invalid"
"""Node 0's name on a first launch whose node 0 starts after node 1: no DNS answers for it; the test adds
it to the launcher's own /etc/hosts once the launcher is waiting."""
LATE_S = 5.0


def in_own_hosts(hosts: Path, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own whose /etc/hosts is `hosts` (the machine's is untouched):
    the launcher's real getaddrinfo, through nsswitch's `files`, sees a line appended to `hosts`."""
    script = 'mount --bind "$1" /etc/hosts && shift && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(hosts), *argv]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare: a mount namespace"
)
def test_a_first_group_node_waits_for_node_0s_name_and_starts_once_it_resolves(tmp_path: Path) -> None:
    """Node 1 of a first launch starts before node 0 has a DNS record (a Kubernetes pod's appears once it
    has an IP): with --master-wait-s (what launch.k8s renders for a live --nodes N) its launcher asks again
    until the name resolves, then starts its ranks in the first group (without it: exit 2, FailIndex)."""
    job = Job(tmp_path, LATE)
    hosts = tmp_path / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text())
    founder = job.lock()
    try:
        assert live_start.replaces_a_lost_node(founder, str(job.run_dir)) == 0
        argv = launcher_argv("torchlaunch.agent", *job.args(1, "--master-wait-s", "60"))
        start = time.monotonic()
        proc = subprocess.Popen(
            in_own_hosts(hosts, argv),
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            time.sleep(LATE_S)  # node 0 "starts" now: its record appears
            assert proc.poll() is None, "the launcher did not wait for node 0's name"
            with hosts.open("a") as f:  # in place: the bind mount shows this very file
                f.write(f"127.0.0.1 {LATE}\n")
            appeared = time.monotonic()
            lines, code = started_ranks(proc)
            ranks_at = time.monotonic()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
    finally:
        founder.release()
    said = "\n".join(lines)
    assert code is None, f"the launcher ended {code} before starting its ranks:\n{said}"
    assert "does not resolve" not in said, said
    agent = lines[-1]
    assert "--join-attempt" not in agent and f"--master-addr {LATE}" in agent, agent  # the first group
    print(
        f"node 0's name appeared {appeared - start:.1f} s after node 1's launcher started; its ranks started {ranks_at - appeared:.1f} s later"
    )


def test_a_rank_that_took_a_peers_state_holds_the_peers_last_save_not_the_loaded_step(tmp_path: Path) -> None:
    """Found by bench.soak: a stop right at a joiner's admission hung both ranks until dist.timeout_s. The
    joiner's load_state_dict marked the peer's step saved (true of a checkpoint, not of a live peer's
    state), so its save() skipped that step while the source entered the save's gather. The member that
    loads now holds the source's own record, so save() decides the same on every member."""
    from types import SimpleNamespace

    import torch

    from tests.helpers import small_trainer
    from torchlaunch.exit_codes import BadInput
    from torchlaunch.worker.groups.live import LiveTrainingGroup, saved_position

    host = small_trainer(tmp_path / "run")
    host.progress.global_step = 13
    seat = SimpleNamespace(joining=True, source=lambda: 0, is_behind=lambda: False)
    group = SimpleNamespace(seat=seat)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:  # the source and the joiner are this one rank: what it sends is what it loads
        assert host.last_saved is None  # the source never saved
        LiveTrainingGroup._share_state(group, host)  # type: ignore[arg-type]
        assert host.last_saved is None, "the loaded step was taken for saved"
        assert seat.joining is False
        host.last_saved = (8, 0, False)
        seat.joining = True
        LiveTrainingGroup._share_state(group, host)  # type: ignore[arg-type]
        assert host.last_saved == (8, 0, False)
    finally:
        torch.distributed.destroy_process_group()
    assert saved_position([13, 1, True]) == (13, 1, True)
    for forged in ([13, 1], ["13", 1, True], [13, 1, 1], {"step": 13}, "x" * 200):
        with pytest.raises(BadInput, match="not \\[step, epoch, val_pending\\]"):
            saved_position(forged)
