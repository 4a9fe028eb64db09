""" "Nodes" on one machine: network namespaces joined by a switch (a bridge in a namespace of its own).

Each node gets its own network namespace, an address on a private /24 (no default route, so no
traffic leaves), its own hostname and /etc/hosts (bind-mounted inside a private mount namespace),
and runs its commands as managed process groups. Faults are injected through `Cluster` methods.

Each node's eth0 is one end of a veth pair whose other end is a port of the switch's bridge, so any
number of nodes reach each other, and taking one node's eth0 down cuts that node alone off.
Namespaces are named PREFIX-<harness pid>-<cluster number>-nodeK (the switch: -switch) so that a later run can tell leftovers of a crashed
harness (pid gone) from a live concurrent one and remove only the former.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from faults import procs

PREFIX = "flt"
SUBNET = ipaddress.ip_network("10.77.0.0/24")
_NAME = re.compile(rf"^{PREFIX}-(\d+)-\d+-(node\d+|switch)$")
MAX_NODES = 200

# Runs inside `ip netns exec NS unshare --uts`: $1 hosts file, $2 hostname, rest the command. The
# check makes a bind mount that did not take effect one clear line instead of a rendezvous timeout.
_NODE_SHIM = (
    'mount --bind "$1" /etc/hosts && hostname "$2" && getent hosts "$2" >/dev/null '
    '|| { echo "faults: node identity not set up ($2 does not resolve in /etc/hosts)" >&2; exit 97; }; '
    'shift 2 && exec "$@"'
)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (for a pytest skip), or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root, or in CI's privileged stage)"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (apt-get install -y iproute2 util-linux mount hostname)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_netns(name: str) -> None:
    path = f"/run/netns/{name}"
    if os.path.exists(path):
        procs.kill_netns_processes(procs.netns_inode(path))
    _ip("netns", "del", name, check=False)  # deleting the namespace also destroys its veth end


def remove_leftovers() -> list[str]:
    """Delete namespaces (and their processes) left by harnesses that died without cleaning up."""
    removed = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_netns(name)
            removed.append(name)
    # A veth created but not yet moved lives in the root namespace: named f"{PREFIX}{pid}[vs]{k}".
    for line in _ip("-o", "link", "show").stdout.splitlines():
        m = re.match(rf"^\d+: ({PREFIX}(\d+)[vs]\d+)[@:]", line)
        if m and not _pid_alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


@dataclass
class Node:
    """One node: its namespace, identity and the process groups started in it."""

    index: int
    hostname: str
    netns: str
    address: str
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def netns_inode(self) -> int:
        return procs.netns_inode(f"/run/netns/{self.netns}")

    def processes(self) -> list[procs.Proc]:
        return procs.processes_in_netns(self.netns_inode)


class Cluster:
    """Context manager: creates the nodes on enter, removes namespaces and processes on exit."""

    _created = itertools.count()

    def __init__(self, nodes: int = 2, workdir: str | os.PathLike[str] | None = None) -> None:
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"a cluster has 2..{MAX_NODES} nodes, got {nodes}")
        self._owner = os.getpid()
        number = next(Cluster._created)
        self.switch = f"{PREFIX}-{self._owner}-{number}-switch"
        self._tmp = tempfile.TemporaryDirectory(prefix="faults-cluster-", dir=workdir)
        self.hosts_file = Path(self._tmp.name) / "hosts"
        hosts = [ipaddress.ip_address(int(SUBNET.network_address) + k + 1) for k in range(nodes)]
        self.nodes = [
            Node(index=k, hostname=f"node{k}", netns=f"{PREFIX}-{self._owner}-{number}-node{k}", address=str(hosts[k]))
            for k in range(nodes)
        ]
        self._active = False

    # ----------------------------------------------------------------------------------- set-up
    def __enter__(self) -> Cluster:
        remove_leftovers()
        atexit.register(self.close)
        self._active = True
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{n.address} {n.hostname}\n" for n in self.nodes))
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            _ip("netns", "add", node.netns)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            # One veth pair per node: one end its eth0, the other a port of the switch's bridge.
            end, port = f"{PREFIX}{self._owner}v{node.index}", f"{PREFIX}{self._owner}s{node.index}"
            _ip("link", "add", end, "type", "veth", "peer", "name", port)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("link", "set", end, "netns", node.netns)
            _ip("-n", node.netns, "link", "set", end, "name", "eth0")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/{SUBNET.prefixlen}", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")

    def close(self) -> None:
        """Kill every process of every node and delete the namespaces; safe to call twice."""
        if not self._active or os.getpid() != self._owner:
            return
        self._active = False
        for node in self.nodes:
            _remove_netns(node.netns)
        _remove_netns(self.switch)
        for node in self.nodes:
            for popen in node.started:
                if popen.poll() is None:
                    popen.kill()
                try:
                    popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self._tmp.cleanup()
        atexit.unregister(self.close)

    # -------------------------------------------------------------------------------- running
    def node_argv(self, node: Node, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` as `node`: its namespace, hostname and /etc/hosts."""
        return [
            "ip", "netns", "exec", node.netns, "unshare", "--uts", "sh", "-c", _NODE_SHIM, "sh",
            str(self.hosts_file), node.hostname, *argv,
        ]  # fmt: skip

    def start(
        self,
        node: Node,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on `node` in its own session (process group); output goes to `log_path`."""
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                self.node_argv(node, argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        node.started.append(popen)
        return popen

    def run(self, node: Node, argv: Sequence[str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a short command on `node` and capture its output."""
        return subprocess.run(
            self.node_argv(node, argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )

    # ---------------------------------------------------------------------------------- faults
    def agent(self, node: Node) -> procs.Proc:
        """The node's torchrun agent (the process running torch.distributed.run)."""
        agents = [p for p in node.processes() if p.runs_module("torch.distributed.run", "torchrun")]
        if len(agents) != 1:
            raise LookupError(f"expected one torchrun agent on {node.hostname}, found {agents}")
        return agents[0]

    def workers(self, node: Node) -> list[procs.Proc]:
        """The agent's children: the worker processes."""
        return procs.children(node.processes(), self.agent(node).pid)

    def signal_top(self, node: Node, sig: signal.Signals = signal.SIGTERM) -> int:
        """Send `sig` to the node's latest started command (its launcher: what a scheduler signals)."""
        pid = node.started[-1].pid
        os.kill(pid, sig)
        return pid

    def kill_worker(self, node: Node, local_rank: int = 0) -> int:
        """kill -9 one worker (the agent's child with this LOCAL_RANK order by pid); returns its pid."""
        workers = sorted(self.workers(node), key=lambda p: p.pid)
        victim = workers[local_rank].pid
        os.kill(victim, signal.SIGKILL)
        return victim

    def kill_node(self, node: Node) -> list[int]:
        """kill -9 everything on the node: agent, workers (also orphans), shells."""
        return procs.kill_netns_processes(node.netns_inode)

    def freeze_node(self, node: Node) -> list[int]:
        """SIGSTOP everything on the node (a whole machine hung: its agent frozen with its ranks);
        returns the pids stopped. Cluster.close (or kill_node) ends them."""
        stopped: list[int] = []
        for _ in range(10):  # again until a sweep finds none new: a process forked during one is stopped too
            new = [p.pid for p in node.processes() if p.pid not in stopped]
            if not new:
                break
            procs.signal_all(new, signal.SIGSTOP)
            stopped += new
        return stopped

    def set_link(self, node: Node, up: bool) -> None:
        """Take the node's eth0 down or up: down cuts its veth pair's carrier, so the node is off the
        switch (the others still reach each other)."""
        _ip("-n", node.netns, "link", "set", "eth0", "up" if up else "down")
