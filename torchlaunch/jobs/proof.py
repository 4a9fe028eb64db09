"""Proof that a job record's process or job is this run's, before `cancel` signals or scancels it.

A record is a file in the run dir: anyone who can write there can name any pid (with the start time
anyone can read from /proc) or any Slurm job id. So a record is only a claim, and cancel acts on it
only with proof that no forger can make:

- local: the launcher makes a random token per launch, puts it in its children's environment and
  only its SHA-256 in the record. A process is this run's launcher when one of its children holds a
  token with the recorded digest in /proc/PID/environ, which only the process's owner (or root) can
  read: an unrelated process has no such child, and another user's launcher's token cannot be read.
- a scheduler's job: the job names this run dir itself, in what only its owner can set (each backend
  proves its own: torchlaunch.backends.slurm.proof).
"""

from __future__ import annotations

import hashlib
import os
import secrets

from torchlaunch import contract
from torchlaunch.base import files
from torchlaunch.base.untrusted import whole

TOKEN_ENV = contract.LAUNCH_TOKEN
DIGEST_KEY = "token_sha256"
"""The record's extra field holding the token's digest."""
QUERY_TIMEOUT_S = 20


def new_token() -> str:
    return secrets.token_hex(16)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            text = files.read_range(f"/proc/{pid}/task/{task}/children", 0, 1 << 16)[0].decode()
        except (OSError, UnicodeDecodeError):
            continue
        found.extend(n for n in map(whole, text.split()) if n is not None)
    return found


def _environ_token(pid: int) -> str | None:
    try:
        raw = files.read_range(f"/proc/{pid}/environ", 0, 1 << 20)[0]
    except OSError:
        return None
    prefix = f"{TOKEN_ENV}=".encode()
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode("ascii", "replace")
    return None


def local_launcher(pid: int, recorded: str | None) -> str | None:
    """None when `pid` is proven this run's launcher, else why not (one clause for the refusal)."""
    if not recorded:
        return "the record holds no launch token digest (written by an older version, or forged)"
    for child in _children(pid):
        token = _environ_token(child)
        if token is not None and secrets.compare_digest(digest(token), recorded):
            return None
    return "none of its children holds the launch token the record names (the record is not this run's)"
