"""`python -m torchlaunch.launch.torchrun ARGS` = `torchrun ARGS`, leaving without interpreter teardown.

Tearing down an interpreter that has imported torch takes ~0.8 s on a 2-core box (measured: 0.04 s
with os._exit), and launch.local waits for torchrun's exit, so every run paid it after the last
worker had already finished. The agent's work is done when its main returns: its workers have
exited, their files are closed. Exit codes and the failure traceback (which launch.local's relay
holds back or prints) are the same as torchrun's.

An elastic agent first makes sure a rendezvous store already up at its endpoint is its own job's
(launch.elastic.check_store): here, where torch is imported anyway, the check costs a connection, where
the launcher would pay a torch import and arrive late to its job's rendezvous. A store of another job
is bad input, reported as rank 0's outcome (torchlaunch.status), so the launcher says it in one line and
exits 2 without the agent ever joining that store.

A user script's elastic job meets in the run dir (`--rdzv-backend torchlaunch-rundir`, rdzv_file.py):
its handler is registered here, before torchrun's main looks it up, and a state there that this run did
not seal is bad input the same way (one line, exit 2), raised before torch unpickles a byte of it.
"""

from __future__ import annotations

import os
import sys
import traceback

from torchlaunch import status
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, BadInput
from torchlaunch.launch import elastic, rdzv_file


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def foreign_store(argv: list[str]) -> str | None:
    """The refusal line when `argv` is an elastic agent's (--nnodes MIN:MAX) and the store up at its
    --rdzv-endpoint belongs to another rendezvous than its --rdzv-id; None otherwise."""
    nodes, endpoint, rdzv_id = (_value(argv, f) for f in ("--nnodes", "--rdzv-endpoint", "--rdzv-id"))
    if _value(argv, "--rdzv-backend") == rdzv_file.BACKEND:  # the run dir's: no store to belong to a job
        return None
    if nodes is None or ":" not in nodes or endpoint is None or rdzv_id is None:
        return None
    host, _, port = endpoint.rpartition(":")
    try:
        elastic.check_store(host, int(port), rdzv_id)
    except BadInput as refused:
        return str(refused)
    return None


AGENT_STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
"""What the agent passes on to its workers' process groups (torchrun's own default lacks SIGUSR1/SIGUSR2,
so a Slurm-style signal to every process killed the agent, and the ranks with it, before they committed)."""


def main() -> int:
    from torch.distributed.run import main as torchrun_main

    from torchlaunch import compat

    compat.agent_stops_once()  # a repeated stop never cuts the ranks' checkpoint short
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_STOP_SIGNALS)

    refused = foreign_store(sys.argv[1:])
    if refused is not None:
        status.report(0, BAD_INPUT, refused)
        return BAD_INPUT
    from torchlaunch.launch import rdzv_torch

    rdzv_torch.register(sys.argv[1:])
    try:
        torchrun_main()
    except BadInput as refused_state:  # the run-dir rendezvous: a state it did not seal, a run dir without flock
        status.report(0, BAD_INPUT, str(refused_state))
        return BAD_INPUT
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # what the interpreter does with a message as exit code
            code = FAILURE
        return code or 0
    except KeyboardInterrupt:
        raise  # the interpreter's own exit by SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter would print it and exit 1: same here
        traceback.print_exc()
        return FAILURE
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
