"""The run's secret: what only the run's own ranks hold, so that only they are ever seated in its group.

Why: the membership service (torchft's Lighthouse) seats whoever asks it for a quorum, and anything that
reaches its port can ask (loopback on a shared host, the job's network): a stranger with an id that
sorted first was seated as rank 0 (issue 52). The Lighthouse is torchft's Rust server and checks
nothing, so the members check each other: every member's entry at the service carries its store address
sealed under the secret (a stranger cannot make one, and the service's status page shows no address
anyone can use), and before a group forms every member proves to every other that it holds the secret
for this quorum (group.LiveGroup, a tag over the quorum's token: challenge-response, never the secret
itself on the wire). A member that does not prove itself is left out of the group its peers form.

Where it lives: RUN_DIR/live/secret, 32 random bytes, mode 0600, made once by the first rank of the run
that needs it (a create that cannot replace, so every rank of every node reads the same one) and read
only if it belongs to this user and nobody else may read it. The run dir is the one thing every rank of
a run shares on every launcher (Slurm's shared filesystem, Kubernetes' RWX volume), and only its owner
can read the file. Torch-free.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from torchlaunch import rundir
from torchlaunch.base.untrusted import quote
from torchlaunch.exit_codes import BadInput

SECRET = "secret"
SECRET_BYTES = 32
SEALED_PREFIX = "tl1."
"""A sealed store address: tl1.<hex of the address xor a keystream>.<hex MAC>."""
MAX_ADDRESS = 300
CREATE_TRIES = 3


@dataclass(frozen=True)
class RunKey:
    """The secret of one run, and what is derived from it."""

    secret: bytes

    @property
    def tag(self) -> str:
        """8 hex digits that name the run in its replica ids (namespaced by run: two runs on one service
        never take each other's ids); a one-way hash, so it tells nothing of the secret."""
        return hashlib.blake2b(self.secret, digest_size=4, person=b"tl-run-tag").hexdigest()

    def _mac(self, *parts: str) -> str:
        return hmac.new(self.secret, "\x00".join(parts).encode("utf-8"), hashlib.sha256).hexdigest()

    def _stream(self, replica_id: str, length: int) -> bytes:
        out, counter = b"", 0
        while len(out) < length:
            out += hmac.new(self.secret, f"addr\x00{replica_id}\x00{counter}".encode(), hashlib.sha256).digest()
            counter += 1
        return out[:length]

    def seal(self, replica_id: str, address: str, step: int) -> str:
        """The store address as the service shows it: unreadable and unforgeable without the secret, and
        bound to the member's id and step (a copy under another id or step does not open)."""
        raw = address.encode("utf-8")
        hidden = bytes(a ^ b for a, b in zip(raw, self._stream(replica_id, len(raw)), strict=True))
        return f"{SEALED_PREFIX}{hidden.hex()}.{self._mac('seal', replica_id, address, str(step))[:32]}"

    def unseal(self, replica_id: str, sealed: str, step: int) -> str | None:
        """seal()'s address, or None when `sealed` is not one this run's secret made for that id and step."""
        if not sealed.startswith(SEALED_PREFIX) or len(sealed) > 2 * MAX_ADDRESS + 40:
            return None
        body, _, mac = sealed[len(SEALED_PREFIX) :].partition(".")
        try:
            hidden = bytes.fromhex(body)
        except ValueError:
            return None
        raw = bytes(a ^ b for a, b in zip(hidden, self._stream(replica_id, len(hidden)), strict=True))
        try:
            address = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
        expected = self._mac("seal", replica_id, address, str(step))[:32]
        return address if hmac.compare_digest(mac, expected) else None

    def proof(self, token: str, replica_id: str, address: str, step: int) -> str:
        """A member's answer to a quorum's challenge (its token, new for every quorum): only a holder of
        the secret can make it, and it is good for this quorum, id, address and step only."""
        return self._mac("proof", token, replica_id, address, str(step))

    def hidden(self, *parts: str) -> str:
        """A store key's name that only a holder of the secret can compute: a stranger who finds a rank's
        store by a port scan can write into it, but cannot name (so cannot overwrite) a member's answer or
        its group's rendezvous keys; the c10d store lists no keys."""
        return self._mac("name", *parts)[:32]

    @property
    def presence_key(self) -> bytes:
        """The key a rank's presence hello proves (live/presence.py) at a service given this run's
        secret (`python -m launch.lighthouse --secret-file`): derived, so the secret itself is never used
        for two things."""
        return hmac.new(self.secret, b"presence", hashlib.sha256).digest()

    @property
    def rendezvous_key(self) -> bytes:
        """The key that seals a user script's rendezvous state in the run dir (launch/rdzv_file.py), derived
        as presence_key is: a seal proves the state came from a holder of the secret, and tells nothing of it."""
        return hmac.new(self.secret, b"rendezvous", hashlib.sha256).digest()

    def proves(self, answer: bytes | str, token: str, replica_id: str, address: str, step: int) -> bool:
        text = answer.decode("ascii", "replace") if isinstance(answer, bytes) else answer
        return hmac.compare_digest(text, self.proof(token, replica_id, address, step))


def _create(folder: int) -> None:
    """RUN_DIR/live/secret made once, 0600 (rundir.create_once: another rank's, made first, is kept)."""
    rundir.create_once(SECRET, secrets.token_bytes(SECRET_BYTES), dir_fd=folder, mode=0o600)


def _read(folder: int, where: Path, name: str = SECRET) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise BadInput(
                f"live error: {quote(str(where))} must be a file of this user that nobody else may read "
                "(mode 0600): it is the run's secret; remove it and launch again to make a new one"
            )
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise BadInput(f"live error: {quote(str(where))} is not a run secret ({len(data)} bytes, not {SECRET_BYTES})")
    return data


def secret_file(run_dir: str | os.PathLike[str]) -> str:
    """Where a run's secret lives: what a membership service that shares the run dir is given
    (`--secret-file`, and the rendered Kubernetes Deployment's argument)."""
    return str(rundir.live(run_dir) / SECRET)


def load(run_dir: str | os.PathLike[str]) -> RunKey:
    """The run's key, its secret made first if the run has none yet (any rank or launcher may be first).
    BadInput, one line, when the file is a link, another user's, readable by others or not a secret."""
    folder_path = rundir.live(run_dir)
    where = folder_path / SECRET
    try:
        folder_path.mkdir(parents=True, exist_ok=True)
        folder = rundir.open_folder(folder_path)
    except OSError as e:
        raise BadInput(f"live error: cannot open {quote(str(folder_path))}: {quote(e.strerror or str(e))}") from None
    try:
        for _ in range(CREATE_TRIES):  # a shared filesystem may show another node's new file a moment late
            try:
                return RunKey(_read(folder, where))
            except FileNotFoundError:
                _create(folder)
        raise BadInput(f"live error: the run's secret {quote(str(where))} is gone each time it is made")
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadInput(
                f"live error: {quote(str(where))} is a symlink: the run's secret is never read through one"
            ) from None
        raise BadInput(f"live error: cannot read the run's secret {quote(str(where))}: {quote(str(e))}") from None
    finally:
        os.close(folder)


def existing(path: str | os.PathLike[str]) -> RunKey | None:
    """The run's key from its secret file at `path` (RUN_DIR/live/secret) once a rank has made it, None
    before; the same checks as load(): BadInput, one line, when it is a link, another user's, readable by
    others or not a secret. For a membership service that shares the run dir (it never makes one)."""
    where = Path(path)
    try:
        folder = os.open(where.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadInput(f"live error: cannot open {quote(str(where.parent))}: {quote(e.strerror or str(e))}") from None
    try:
        return RunKey(_read(folder, where, where.name))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadInput(f"live error: cannot read the run's secret {quote(str(where))}: {quote(str(e))}") from None
    finally:
        os.close(folder)
