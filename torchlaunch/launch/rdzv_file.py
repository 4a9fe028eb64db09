"""A user script's elastic rendezvous in the run dir: no training node hosts it, so none takes it along.

    python -m launch.local --nnodes 1:2 --run-dir /shared/run --max-restarts 3 -- train.py   # on each node

Why: torchrun's c10d rendezvous keeps its state in a TCP store that the agent on the --master-addr host
serves. A script under torchrun's contract cannot regroup in process, so a lost node costs a restart of
the survivors' agents, which meet again in that store: when the lost node is the store's host, there is
nothing to meet in, and the job ends (issue 54: the survivor exits 1). The run dir is what every node of
the job shares already (its lock, job records, the script's checkpoints), so the state lives there:

- RUN_DIR/rdzv/ID.INC.state: the rendezvous state torch's DynamicRendezvousHandler keeps (pickled by the
  handler itself), written by compare-and-set under an flock on ID.INC.lock, atomically (temp + rename,
  mode 0600, never through a link). INC is the job's incarnation (runlock.Holder.incarnation), so a rerun
  after every node left never meets the closed state of the run before.
- RUN_DIR/rdzv/ID.INC.store: a c10d FileStore, the agents' per-round store (worker ranks, the address of
  the round's rank 0). The workers' own TCPStore is served by the worker of global rank 0 of the round
  (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torch's own opt-out): after a loss that is a survivor, never the
  node that is gone (agent.ranks.launch_env sets it for every agent: torch's shared agent store keeps a
  cached address across rounds, pytorch#135712).

Why sealed: the handler unpickles whatever the backend returns, and unpickling runs code. Every state is
written with an HMAC under a key derived from the run's secret (RUN_DIR/live/secret, 0600, this user's:
live/runkey.py), over the rendezvous name, the generation and the bytes, and a state whose seal
does not verify is refused in one line (exit 2) before torch sees a byte of it. What a stranger who can
write the run dir can still do: delete or garble the files, or put back an older state of this same
rendezvous (the job stops or re-forms: a denial of service, as deleting the checkpoints is), and edit the
FileStore's plain values (the address the workers meet at: as reachable as torchrun's own TCP store).

Torch-free (the launcher imports it); the torch side, RendezvousBackend and handler, is rdzv_torch.py.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import stat
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import elastic

try:
    import fcntl
except ImportError:  # not POSIX: no compare-and-set here
    fcntl = None  # type: ignore[assignment]

BACKEND = "torchlaunch-rundir"
"""torchrun's --rdzv-backend name for this rendezvous (registered by torchlaunch.launch.torchrun)."""
INCARNATION = "incarnation"
"""The --rdzv-conf key that carries the job's incarnation to the agent (set by the launcher, not a user)."""
MAGIC = b"TLRDZV1\n"
GENERATION_BYTES = 8
SEAL_BYTES = 32
MAX_STATE = 4 << 20
"""A rendezvous state of a few nodes is a few KB; a bigger file is refused unread."""
NAME = re.compile(r"[A-Za-z0-9_-]{1,80}")
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
PREFIX = "rendezvous error: "


def job_key(rdzv_id: str) -> str:
    """The run-dir lock's job of launchers that meet in the run dir (runlock: they share it)."""
    return f"elastic:{rdzv_id}@run-dir"


def torchrun_options(run_dir: str, rdzv_id: str, conf: tuple[tuple[str, int], ...], incarnation: str) -> list[str]:
    """torchrun's rendezvous options (pure): the run dir is the endpoint, no node rank, no host. Without
    an incarnation (--dry-run: no launcher has joined the job) the agent uses the id alone."""
    pairs = [f"{k}={v}" for k, v in elastic.torchrun_conf(conf)]
    if incarnation:
        pairs.append(f"{INCARNATION}={incarnation}")
    argv = ["--rdzv-backend", BACKEND, "--rdzv-endpoint", os.path.abspath(run_dir), "--rdzv-id", rdzv_id]
    return argv + (["--rdzv-conf", ",".join(pairs)] if pairs else [])


def name_of(rdzv_id: str, incarnation: str) -> str:
    """The files' stem for one job's incarnation; BadInput for a name that is no plain word (never a path)."""
    for part in (rdzv_id, incarnation or "0"):
        if not NAME.fullmatch(part):
            raise BadInput(f"{PREFIX}{quote(part, 80)} is not a rendezvous name (letters, digits, - and _)")
    return f"{rdzv_id}.{incarnation or '0'}"


def seal(key: bytes, name: str, generation: int, state: bytes) -> bytes:
    """The MAC of one written state: bound to the rendezvous and the generation, so a state of another
    job or incarnation does not open here."""
    head = b"rdzv\x00" + name.encode() + b"\x00" + generation.to_bytes(GENERATION_BYTES, "big")
    return hmac.new(key, head + state, hashlib.sha256).digest()


def open_folder(run_dir: str | os.PathLike[str]) -> int:
    """RUN_DIR/rdzv, made 0700 if absent, opened without following a link (rundir.open_folder)."""
    folder = rundir.rdzv(run_dir)
    folder.mkdir(mode=0o700, exist_ok=True)
    return rundir.open_folder(folder)


class StateFile:
    """One rendezvous's sealed state in the run dir: get and compare-and-set, the token being the seal
    of the state read (so a token names one write: a stale one never matches a later state)."""

    def __init__(self, run_dir: str | os.PathLike[str], name: str, key: bytes) -> None:
        self.run_dir, self.name, self.key = Path(run_dir), name, key
        self.where = rundir.rdzv(run_dir) / f"{name}.state"

    def get(self) -> tuple[bytes, bytes] | None:
        """(state, token), or None before the first write; BadInput (one line) when the file there was
        not sealed by this run: its bytes are never returned."""
        found = self._read()
        return None if found is None else (found[2], found[1])

    def compare_set(self, state: bytes, token: bytes | None) -> tuple[bytes, bytes, bool] | None:
        """Write `state` if the current one is still `token`'s (None: no state yet), under the flock.
        (state now, its token, whether ours was written); None when there is no state and ours lost."""
        folder = open_folder(self.run_dir)
        try:
            lock = self._lock(folder)
            try:
                current = self._read()
                held = current[1] if current is not None else None
                if not _same(held, token):
                    return None if current is None else (current[2], current[1], False)
                generation = current[0] + 1 if current is not None else 1
                mac = seal(self.key, self.name, generation, state)
                data = MAGIC + generation.to_bytes(GENERATION_BYTES, "big") + mac + state
                rundir.write_bytes(self.where, data, durable=False, mkdir=False, real_folder=True, mode=0o600)
                return state, mac, True
            finally:
                os.close(lock)
        finally:
            os.close(folder)

    def _lock(self, folder: int) -> int:
        if fcntl is None:
            raise BadInput(f"{PREFIX}this system has no flock: run the job with --master-addr (torchrun's c10d store)")
        fd = os.open(f"{self.name}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for one read and one rename; the kernel frees it with us
        except OSError as e:
            os.close(fd)
            if e.errno in NO_FLOCK:
                raise BadInput(
                    f"{PREFIX}the filesystem of {quote(str(self.run_dir))} has no flock, which the run-dir rendezvous "
                    "needs: mount it with locks, or drop --run-dir and pass --master-addr (torchrun's c10d store)"
                ) from None
            raise
        return fd

    def _read(self) -> tuple[int, bytes, bytes] | None:
        """(generation, seal, state) of a file whose seal verifies; None when absent; BadInput otherwise."""
        try:
            folder = rundir.open_folder(rundir.rdzv(self.run_dir))
        except FileNotFoundError:
            return None
        try:
            fd = os.open(self.where.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._refusal(f"cannot be opened ({e.strerror or e})") from None
        finally:
            os.close(folder)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise self._refusal("is not a regular file of this user")
            data = os.read(fd, len(MAGIC) + GENERATION_BYTES + SEAL_BYTES + MAX_STATE + 1)
        finally:
            os.close(fd)
        return self._opened(data)

    def _opened(self, data: bytes) -> tuple[int, bytes, bytes]:
        head = len(MAGIC) + GENERATION_BYTES + SEAL_BYTES
        if len(data) < head or len(data) > head + MAX_STATE or not data.startswith(MAGIC):
            raise self._refusal("is not a rendezvous state of this launcher")
        generation = int.from_bytes(data[len(MAGIC) : len(MAGIC) + GENERATION_BYTES], "big")
        mac, state = data[head - SEAL_BYTES : head], data[head:]
        if not hmac.compare_digest(mac, seal(self.key, self.name, generation, state)):
            raise self._refusal("does not carry this run's seal (written by something else than its agents)")
        return generation, mac, state

    def _refusal(self, why: str) -> BadInput:
        return BadInput(
            f"{PREFIX}{quote(str(self.where), 160)} {why}: refused unread; if no stranger writes the run dir, "
            "remove it and launch again"
        )


def _same(held: bytes | None, token: object) -> bool:
    if held is None or token is None:
        return held is None and token is None
    return isinstance(token, bytes) and hmac.compare_digest(held, token)


def store_path(run_dir: str | os.PathLike[str], name: str) -> tuple[str, int]:
    """The agents' FileStore file for `name`, made 0600 if absent, and the folder's descriptor (the caller
    keeps it open: the path names the real folder behind it, /proc/self/fd/N/..., so a link swapped in for
    RUN_DIR/rdzv later is not followed by the store). BadInput when the file there is a link or another's."""
    folder = open_folder(run_dir)
    file = f"{name}.store"
    try:
        fd = os.open(file, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
    except OSError as e:
        os.close(folder)
        raise BadInput(
            f"{PREFIX}{quote(str(rundir.rdzv(run_dir) / file), 160)}: {quote(e.strerror or str(e))}"
        ) from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(folder)
        raise BadInput(f"{PREFIX}{quote(str(rundir.rdzv(run_dir) / file), 160)} is not a regular file of this user")
    pinned = rundir.folder_path(folder)
    return str((pinned or rundir.rdzv(run_dir)) / file), folder


def sweep(run_dir: str | os.PathLike[str], keep: str) -> int:
    """Remove the files of other incarnations than `keep` from RUN_DIR/rdzv (the founder of a new
    incarnation calls it: no member of an older one is alive). Unlinks never follow a link. The count."""
    try:
        folder = rundir.open_folder(rundir.rdzv(run_dir))
    except FileNotFoundError:
        return 0
    removed = 0
    try:
        for entry in os.listdir(folder):
            parts = entry.split(".")
            if len(parts) == 3 and parts[1] != keep and parts[2] in ("state", "lock", "store"):
                try:
                    os.unlink(entry, dir_fd=folder)
                    removed += 1
                except OSError:
                    pass  # gone already, or not ours to remove
    finally:
        os.close(folder)
    return removed
